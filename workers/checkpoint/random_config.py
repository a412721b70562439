"""Tiny transformers configs of varied shapes, for tests (no weights are built here).

    random_tiny_config(Arch.BAMBA)                           # the tiny preset
    random_tiny_config(Arch.BAMBA, seed=3)                   # a random tiny shape
    random_tiny_config(Arch.NEMOTRON_H, layer_pattern="*M-M*", mamba_n_groups=4)

Overrides named like a ModelShape field change the shape (and are validated with it);
any other override is passed to the transformers config class unchanged.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from transformers import PretrainedConfig

from workers.checkpoint.configs import build_config
from workers.checkpoint.presets import Arch, LayerKind, ModelShape, PositionEmbedding, Preset, preset_shape

_SHAPE_FIELDS = {f.name for f in dataclasses.fields(ModelShape)}


def _divisors(n: int, candidates: tuple[int, ...]) -> list[int]:
    return [c for c in candidates if n % c == 0]


def _random_pattern(arch: Arch, rng: random.Random) -> str:
    kinds = [LayerKind.MAMBA, LayerKind.ATTENTION]
    if arch is Arch.NEMOTRON_H:
        kinds.append(LayerKind.MLP)
    length = rng.randint(3, 7)
    while True:  # at least one attention and one Mamba layer, or the config is not hybrid
        pattern = "".join(rng.choice(kinds).value for _ in range(length))
        if LayerKind.MAMBA.value in pattern and LayerKind.ATTENTION.value in pattern:
            return pattern


def random_tiny_shape(arch: Arch, seed: int) -> ModelShape:
    rng = random.Random(seed)
    hidden = rng.choice((32, 48, 64))
    heads = rng.choice(_divisors(hidden, (2, 4, 8)))
    mamba_head_dim = rng.choice(_divisors(2 * hidden, (8, 16)))
    mamba_heads = 2 * hidden // mamba_head_dim
    return ModelShape(
        hidden_size=hidden,
        layer_pattern=_random_pattern(Arch(arch), rng),
        num_attention_heads=heads,
        num_key_value_heads=rng.choice(_divisors(heads, (1, 2, 4, 8))),
        mlp_intermediate_size=rng.choice((hidden, 2 * hidden, 3 * hidden)),
        mamba_head_dim=mamba_head_dim,
        mamba_n_groups=rng.choice(_divisors(mamba_heads, (1, 2, 4))),
        mamba_d_state=rng.choice((8, 16)),
        mamba_chunk_size=rng.choice((8, 16, 32)),
        max_position_embeddings=4096,
        position_embedding=rng.choice(list(PositionEmbedding)),
        rope_theta=rng.choice((10000.0, 500000.0)),
        initializer_range=1.0 / hidden**0.5,
    )


def random_tiny_config(arch: Arch | str, seed: int | None = None, **overrides: Any) -> PretrainedConfig:
    """The tiny preset (seed=None) or a random tiny shape (seed given), with overrides."""
    arch = Arch(arch)
    shape = preset_shape(arch, Preset.TINY) if seed is None else random_tiny_shape(arch, seed)
    shape_overrides = {k: v for k, v in overrides.items() if k in _SHAPE_FIELDS}
    hf_overrides = {k: v for k, v in overrides.items() if k not in _SHAPE_FIELDS}
    return build_config(arch, dataclasses.replace(shape, **shape_overrides), **hf_overrides)
