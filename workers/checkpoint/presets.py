"""Architecture-neutral shapes of the built-in random checkpoints.

A `ModelShape` describes one model with the Nemotron-H layer alphabet:

    "M"  Mamba2 mixer          "*"  full attention (GQA)          "-"  MLP alone

Bamba and Granite 4.0-H layers are "mixer + MLP", so their patterns use only "M" and
"*" (the MLP comes with every layer); Nemotron-H layers are a single block each, so its
patterns interleave "-" explicitly. `configs.py` turns a shape into a transformers config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum


class Arch(str, Enum):
    BAMBA = "bamba"
    GRANITEMOEHYBRID = "granitemoehybrid"
    NEMOTRON_H = "nemotron_h"


class Preset(str, Enum):
    TINY = "tiny"  # unit tests: loads and runs in milliseconds
    SMALL = "small"  # built-in demo default, ~10M parameters
    BENCH = "bench"  # CPU benchmarks, 30-100M parameters


class PositionEmbedding(str, Enum):
    """Granite 4.0-H only; Bamba and Nemotron-H always use RoPE and no positions, respectively."""

    ROPE = "rope"
    NOPE = "nope"


class LayerKind(str, Enum):
    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    layer_pattern: str
    num_attention_heads: int
    num_key_value_heads: int
    mlp_intermediate_size: int
    mamba_head_dim: int
    mamba_n_groups: int
    mamba_d_state: int
    mamba_chunk_size: int
    max_position_embeddings: int
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    position_embedding: PositionEmbedding = PositionEmbedding.ROPE
    rope_theta: float = 10000.0
    # ~1/sqrt(hidden_size): every projection roughly keeps the scale of its input, so
    # attention is not uniform and Mamba states matter; with the usual 0.02 the random
    # model is nearly a bigram table and cache bugs would barely change its outputs.
    initializer_range: float = 0.125

    def __post_init__(self) -> None:
        kinds = {k.value for k in LayerKind}
        if not self.layer_pattern or set(self.layer_pattern) - kinds:
            raise ValueError(f"layer_pattern must use only {sorted(kinds)}: {self.layer_pattern!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("num_attention_heads must divide hidden_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if self.mamba_intermediate_size % self.mamba_head_dim:
            raise ValueError("mamba_head_dim must divide mamba_expand * hidden_size")
        if self.mamba_num_heads % self.mamba_n_groups:
            raise ValueError("mamba_n_groups must divide the number of mamba heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba_num_heads(self) -> int:
        return self.mamba_intermediate_size // self.mamba_head_dim

    def layer_indices(self, kind: LayerKind) -> list[int]:
        return [i for i, c in enumerate(self.layer_pattern) if c == kind.value]


_TINY = ModelShape(
    hidden_size=64,
    layer_pattern="*MM*M",  # attention first and in the middle
    num_attention_heads=4,
    num_key_value_heads=2,
    mlp_intermediate_size=128,
    mamba_head_dim=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_chunk_size=16,  # short prompts already span several chunks
    max_position_embeddings=4096,
)
_SMALL = ModelShape(
    hidden_size=256,
    layer_pattern="MM*MMM*M",
    num_attention_heads=8,
    num_key_value_heads=4,
    mlp_intermediate_size=768,
    mamba_head_dim=32,
    mamba_n_groups=2,
    mamba_d_state=64,
    mamba_chunk_size=64,
    max_position_embeddings=8192,
    position_embedding=PositionEmbedding.NOPE,
    initializer_range=0.0625,
)
_BENCH = ModelShape(
    hidden_size=512,
    layer_pattern="MMM*" * 4,  # 1 attention : 3 mamba, like the production hybrids
    num_attention_heads=8,
    num_key_value_heads=2,
    mlp_intermediate_size=1536,
    mamba_head_dim=64,
    mamba_n_groups=2,
    mamba_d_state=128,
    mamba_chunk_size=128,
    max_position_embeddings=32768,
    position_embedding=PositionEmbedding.NOPE,
    initializer_range=0.044,
)

# Nemotron-H blocks are single mixers, so its patterns are longer and spell out the MLPs;
# the tiny one puts attention in the middle and last (Bamba's puts it first).
_NEMOTRON_PATTERNS = {
    Preset.TINY: "M*-M-*",
    Preset.SMALL: "M-M*-M-M-M*-M-",
    Preset.BENCH: "M-M-M-*-" * 4,
}
# Granite 4.0-H tiny keeps RoPE (the other presets use NoPE like the released models) and
# ends on an attention layer.
_GRANITE_TINY_PATTERN = "M*MM*"

PRESETS: dict[Preset, dict[Arch, ModelShape]] = {
    preset: {
        Arch.BAMBA: dataclasses.replace(base, position_embedding=PositionEmbedding.ROPE),
        Arch.GRANITEMOEHYBRID: (
            dataclasses.replace(base, layer_pattern=_GRANITE_TINY_PATTERN) if preset is Preset.TINY else base
        ),
        Arch.NEMOTRON_H: dataclasses.replace(
            base, layer_pattern=_NEMOTRON_PATTERNS[preset], position_embedding=PositionEmbedding.NOPE
        ),
    }
    for preset, base in ((Preset.TINY, _TINY), (Preset.SMALL, _SMALL), (Preset.BENCH, _BENCH))
}


def preset_shape(arch: Arch, preset: Preset) -> ModelShape:
    return PRESETS[Preset(preset)][Arch(arch)]
