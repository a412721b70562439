"""Mixture-of-experts variants of the built-in checkpoints (Granite 4.0-H Tiny-like, Nemotron 3
Nano-like): configs that say MoE, transformers loads and runs them, the dense presets are untouched."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.checkpoint import Arch, Preset, build_config, make_model, preset_shape, run_make_model
from workers.checkpoint.presets import PRESETS, LayerKind, ModelShape, MoeShape
from workers.cli import build_parser

MOE_ARCHS = [Arch.GRANITEMOEHYBRID, Arch.NEMOTRON_H]


def _num_params(config) -> tuple[int, int]:
    """(all parameters, routed-expert parameters)"""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts." in n and "shared" not in n)
    return sum(p.numel() for p in model.parameters()), experts


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_model(root / arch.value, arch, Preset.TINY, seed=0, moe=True) for arch in MOE_ARCHS}


def test_dense_presets_have_no_experts():
    for preset, shapes in PRESETS.items():
        for arch, shape in shapes.items():
            assert shape.moe is None and LayerKind.MOE.value not in shape.layer_pattern, (arch, preset)
    assert build_config(Arch.GRANITEMOEHYBRID, preset_shape(Arch.GRANITEMOEHYBRID, Preset.BENCH)).num_local_experts == 0


@pytest.mark.parametrize("arch", MOE_ARCHS, ids=lambda a: a.value)
@pytest.mark.parametrize(("preset", "low", "high"), [(Preset.TINY, 0, 1_000_000), (Preset.BENCH, 30_000_000, 100_000_000)])
def test_moe_sizes(arch, preset, low, high):
    total, experts = _num_params(build_config(arch, preset_shape(arch, preset, moe=True)))
    assert low <= total <= high
    assert experts > total / 4  # the experts are most of an MoE model


def test_granite_moe_config():
    config = build_config(Arch.GRANITEMOEHYBRID, preset_shape(Arch.GRANITEMOEHYBRID, Preset.TINY, moe=True))
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    assert (config.intermediate_size, config.shared_intermediate_size) == (32, 64)
    assert set(config.layer_types) == {"linear_attention", "full_attention"}


def test_nemotron_moe_config():
    config = build_config(Arch.NEMOTRON_H, preset_shape(Arch.NEMOTRON_H, Preset.TINY, moe=True))
    assert "E" in config.hybrid_override_pattern and "-" not in config.hybrid_override_pattern
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (8, 2, 2, 1)
    assert (config.moe_intermediate_size, config.moe_shared_expert_intermediate_size) == (32, 64)
    assert config.routed_scaling_factor == 2.5 and config.norm_topk_prob
    assert config.moe_latent_size is None


def test_no_moe_variant_is_refused():
    for arch, preset in ((Arch.BAMBA, Preset.TINY), (Arch.NEMOTRON_H, Preset.SMALL)):
        with pytest.raises(ValueError, match="no mixture-of-experts"):
            preset_shape(arch, preset, moe=True)
    with pytest.raises(ValueError, match="only valid for nemotron_h"):
        build_config(Arch.GRANITEMOEHYBRID, preset_shape(Arch.NEMOTRON_H, Preset.TINY, moe=True))
    dense = preset_shape(Arch.NEMOTRON_H, Preset.TINY)
    with pytest.raises(ValueError, match="need a MoeShape"):
        ModelShape(**{**dense.__dict__, "layer_pattern": "ME*"})
    with pytest.raises(ValueError):
        MoeShape(num_experts=4, experts_per_token=5, expert_intermediate_size=8, shared_intermediate_size=8)


@pytest.mark.parametrize("arch", MOE_ARCHS, ids=lambda a: a.value)
def test_transformers_loads_and_runs_moe(moe_dirs, arch):
    model = AutoModelForCausalLM.from_pretrained(moe_dirs[arch], local_files_only=True).eval()
    ids = torch.randint(6, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert logits.shape == (40, model.config.vocab_size) and torch.isfinite(logits).all()
    assert 1.0 < float(logits.std()) < 10.0
    # Tokens really spread over the experts (the router is not degenerate).
    moe = model.model.layers[1].block_sparse_moe if arch is Arch.GRANITEMOEHYBRID else model.model.layers[1].mixer
    hidden = model.model.embed_tokens(ids)[0] if arch is Arch.GRANITEMOEHYBRID else model.model.embeddings(ids)[0]
    router = moe.router if arch is Arch.GRANITEMOEHYBRID else moe.gate
    chosen = router(hidden)[2]
    assert len(set(chosen.flatten().tolist())) >= 3


def test_routing_bias_is_random_and_seeded(moe_dirs, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(moe_dirs[Arch.NEMOTRON_H], local_files_only=True)
    bias = model.model.layers[1].mixer.gate.e_score_correction_bias
    assert float(bias.std()) > 0.01
    again = make_model(tmp_path / "again", Arch.NEMOTRON_H, Preset.TINY, seed=0, moe=True)
    assert (again / "model.safetensors").read_bytes() == (moe_dirs[Arch.NEMOTRON_H] / "model.safetensors").read_bytes()


def test_cli_moe_flag(tmp_path):
    args = build_parser().parse_args(["make-model", str(tmp_path / "m"), "--arch", "nemotron_h", "--preset", "tiny", "--moe"])
    out = run_make_model(args)
    assert json.loads((out / "config.json").read_text())["n_routed_experts"] == 8
    assert not build_parser().parse_args(["make-model", str(tmp_path / "d")]).moe
