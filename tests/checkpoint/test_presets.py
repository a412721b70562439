"""Preset shapes and test configs: sizes, layer placement, and that transformers accepts them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.checkpoint import Arch, Preset, build_config, preset_shape, random_tiny_config
from workers.checkpoint.configs import (
    GRANITE_ATTENTION_MULTIPLIER,
    GRANITE_EMBEDDING_MULTIPLIER,
    GRANITE_LOGITS_SCALING,
    GRANITE_RESIDUAL_MULTIPLIER,
)
from workers.checkpoint.presets import LayerKind


def _num_params(config) -> int:
    with torch.device("meta"):  # shapes only, nothing allocated
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _layer_types(config) -> list[str]:
    return list(config.layers_block_type if hasattr(config, "layers_block_type") else config.layer_types)


@pytest.mark.parametrize("arch", list(Arch))
@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [(Preset.TINY, 0, 1_000_000), (Preset.SMALL, 5_000_000, 15_000_000), (Preset.BENCH, 30_000_000, 100_000_000)],
)
def test_parameter_counts(arch, preset, low, high):
    assert low <= _num_params(build_config(arch, preset_shape(arch, preset))) <= high


@pytest.mark.parametrize("arch", list(Arch))
def test_bench_is_realistic(arch):
    shape = preset_shape(arch, Preset.BENCH)
    attention = len(shape.layer_indices(LayerKind.ATTENTION))
    assert 0 < 3 * attention <= len(shape.layer_indices(LayerKind.MAMBA))
    assert shape.max_position_embeddings >= 16384
    assert shape.mamba_chunk_size in (64, 128)


def test_tiny_places_attention_first_middle_and_last():
    types = {arch: _layer_types(build_config(arch, preset_shape(arch, Preset.TINY))) for arch in Arch}
    assert any(t[0] == "full_attention" for t in types.values())
    assert any(t[-1] == "full_attention" for t in types.values())
    assert any("full_attention" in t[1:-1] for t in types.values())
    for arch in Arch:
        shape = preset_shape(arch, Preset.TINY)
        assert shape.mamba_n_groups == 2 and shape.mamba_head_dim == 16 and shape.mamba_d_state == 16
        assert shape.num_attention_heads > shape.num_key_value_heads  # GQA
        assert "linear_attention" in types[arch] and "full_attention" in types[arch]


def test_granite_multipliers_and_positions():
    tiny = build_config(Arch.GRANITEMOEHYBRID, preset_shape(Arch.GRANITEMOEHYBRID, Preset.TINY))
    small = build_config(Arch.GRANITEMOEHYBRID, preset_shape(Arch.GRANITEMOEHYBRID, Preset.SMALL))
    assert (tiny.position_embedding_type, small.position_embedding_type) == ("rope", "nope")
    assert tiny.num_local_experts == 0
    assert (tiny.embedding_multiplier, tiny.residual_multiplier, tiny.attention_multiplier, tiny.logits_scaling) == (
        GRANITE_EMBEDDING_MULTIPLIER,
        GRANITE_RESIDUAL_MULTIPLIER,
        GRANITE_ATTENTION_MULTIPLIER,
        GRANITE_LOGITS_SCALING,
    )


def test_nemotron_pattern_is_dense():
    for preset in Preset:
        config = build_config(Arch.NEMOTRON_H, preset_shape(Arch.NEMOTRON_H, preset))
        assert set(config.hybrid_override_pattern) <= set("M*-")


def test_overrides_reach_the_config():
    config = random_tiny_config(
        Arch.BAMBA, layer_pattern="M*MM*", mamba_n_groups=4, num_key_value_heads=1, mamba_chunk_size=8
    )
    assert config.attn_layer_indices == [1, 4]
    assert (config.mamba_n_groups, config.num_key_value_heads, config.mamba_chunk_size) == (4, 1, 8)
    nemotron = random_tiny_config(Arch.NEMOTRON_H, layer_pattern="*-M", layer_norm_epsilon=1e-3)
    assert nemotron.hybrid_override_pattern == "*-M" and nemotron.layer_norm_epsilon == 1e-3
    with pytest.raises(ValueError):
        random_tiny_config(Arch.BAMBA, layer_pattern="M-*")  # "-" is Nemotron-only


@pytest.mark.parametrize("arch", list(Arch))
def test_random_tiny_configs_run(arch):
    seen_groups, seen_kv = set(), set()
    for seed in range(6):
        config = random_tiny_config(arch, seed=seed)
        assert config == random_tiny_config(arch, seed=seed)  # seeded, so reproducible
        seen_groups.add(config.n_groups if arch is Arch.NEMOTRON_H else config.mamba_n_groups)
        seen_kv.add(config.num_attention_heads // config.num_key_value_heads)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            logits = model(torch.randint(6, 103, (1, 40))).logits
        assert logits.shape == (1, 40, config.vocab_size) and torch.isfinite(logits).all()
    assert len(seen_groups) > 1 and len(seen_kv) > 1
