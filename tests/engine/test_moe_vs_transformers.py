"""Mixture-of-experts models (Granite 4.0-H MoE, Nemotron-H with "E" layers) == transformers.

The tiny MoE presets (`make_model(..., moe=True)`): logits of every position against
transformers' full forward, one-shot and chunked (decode steps on the fast path's decode
program), the engine's greedy tokens and sampled-from logits, the loader's expert order, and
checks that the routing details the reference uses really matter in these checkpoints (so the
comparisons above could fail).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.engine.conftest import (
    GREEDY,
    Checkpoint,
    LogitRecorder,
    assert_logits_close,
    hf_greedy,
    hf_logits,
    new_engine,
    our_logits,
    prompt_of,
    run_engine,
)
from tests.engine.test_decode_program import ProgramChecker
from workers.checkpoint import Arch, Preset, make_model
from workers.kernels.linear_backends import LinearBackend
from workers.kernels.linear_plan import LinearPlan
from workers.model.config import MixerKind, RouterKind
from workers.model.moe import MoE
from workers.request import KeepState
from workers.sampling import SamplingParams

MOE_ARCHS = [Arch.GRANITEMOEHYBRID, Arch.NEMOTRON_H]
PROMPT_LENGTHS = [1, 7, 16, 17, 33, 47]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[Arch, Checkpoint]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: Checkpoint(make_model(root / arch.value, arch, Preset.TINY, seed=0, moe=True), True) for arch in MOE_ARCHS}


def _moes(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("arch", MOE_ARCHS, ids=lambda a: a.value)
def test_model_is_what_the_config_says(moe, arch):
    model = moe[arch].ours
    moes = _moes(model)
    if arch is Arch.GRANITEMOEHYBRID:
        assert all(isinstance(b.ffn, MoE) for b in model.blocks) and len(moes) == len(model.blocks)
        assert moes[0].shape.router is RouterKind.SOFTMAX_TOPK
    else:
        assert [b.kind is MixerKind.MOE for b in model.blocks] == [c == "E" for c in "ME*MEM*E"]
        assert moes[0].shape.router is RouterKind.SIGMOID_GROUPED and moes[0].shape.n_group == 2
        assert moes[0].score_bias.dtype == torch.float32


@pytest.mark.parametrize("arch", MOE_ARCHS, ids=lambda a: a.value)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
def test_logits_match_transformers_full_forward(moe, arch, fast):
    model = moe[arch].ours
    for length in PROMPT_LENGTHS:
        ids = prompt_of(length, seed=length)
        assert_logits_close(our_logits(model, ids, fast_kernels=fast), hf_logits(moe[arch], ids))


@pytest.mark.parametrize("arch", MOE_ARCHS, ids=lambda a: a.value)
def test_chunked_prefill_then_decode_matches(moe, arch):
    """Chunks across the KV block (16) and Mamba chunk (16) sizes, then single-token decode steps."""
    ids = prompt_of(40, seed=3)
    chunks = [5, 13, 9] + [1] * 13
    assert_logits_close(our_logits(moe[arch].ours, ids, chunks=chunks, block_size=4), hf_logits(moe[arch], ids))


@pytest.mark.parametrize("arch", MOE_ARCHS, ids=lambda a: a.value)
def test_engine_greedy_matches_transformers(moe, arch):
    ckpt = moe[arch]
    engine = new_engine(ckpt.path, max_num_batched_tokens=16)  # prompts prefill in chunks
    prompts = [prompt_of(n, seed=n) for n in (1, 16, 21, 37)]
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert [t.token_id for t in out] == hf_greedy(ckpt, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", MOE_ARCHS, ids=lambda a: a.value)
def test_engine_decode_logits_match_transformers(moe, arch):
    ckpt = moe[arch]
    engine = new_engine(ckpt.path)
    recorder = LogitRecorder(engine)
    prompt = prompt_of(30, seed=4)
    run = run_engine(engine, {"a": prompt})
    full = prompt + run.tokens["a"]
    assert_logits_close(recorder.stacked("a"), hf_logits(ckpt, full[:-1])[len(prompt) - 1 :])


@pytest.mark.parametrize("arch", MOE_ARCHS, ids=lambda a: a.value)
def test_decode_program_runs_moe_with_the_module_forwards_bits(moe, arch):
    """The fast path's decode program keeps MoE layers (as their module forward) and gives the
    bits of the module forward; batched rows route to different experts."""
    engine = new_engine(moe[arch].path, block_size=4, max_num_batched_tokens=12)
    model = engine.runner.model
    engine.runner.set_fast_kernels(True, LinearPlan.fixed(model.blocks, LinearBackend.TORCH))
    assert model.decode_program() is not None
    checker = ProgramChecker(model)
    for i, n in enumerate([3, 9, 17, 4]):
        params = SamplingParams(max_tokens=4 + 3 * (i % 3), temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt_of(n, seed=40 + i), params, keep=KeepState.FREE)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert checker.program_steps >= 5


def test_loader_stacks_experts_in_checkpoint_order(moe):
    granite, nemotron = moe[Arch.GRANITEMOEHYBRID], moe[Arch.NEMOTRON_H]
    hf_moe = granite.hf.model.layers[0].block_sparse_moe
    ours = granite.ours.blocks[0].ffn
    assert torch.equal(ours.experts_up, hf_moe.experts.gate_up_proj)
    assert torch.equal(ours.experts_down, hf_moe.experts.down_proj)
    assert torch.equal(ours.router, hf_moe.router.weight)
    assert torch.equal(ours.shared.up.weight, granite.hf.model.layers[0].shared_mlp.input_linear.weight)
    hf_mixer = nemotron.hf.model.layers[1].mixer
    ours = nemotron.ours.blocks[1].mixer
    assert torch.equal(ours.experts_up, hf_mixer.experts.up_proj)
    assert torch.equal(ours.experts_down, hf_mixer.experts.down_proj)
    assert torch.equal(ours.score_bias, hf_mixer.gate.e_score_correction_bias)
    assert torch.equal(ours.shared.down.weight, hf_mixer.shared_experts.down_proj.weight)


def _hidden_inputs(model, n: int = 64) -> torch.Tensor:
    return torch.randn(n, model.config.hidden_size, generator=torch.Generator().manual_seed(0))


def test_router_matches_transformers_router(moe):
    """Our routing decisions equal transformers' on the same inputs (both families)."""
    granite, nemotron = moe[Arch.GRANITEMOEHYBRID], moe[Arch.NEMOTRON_H]
    x = _hidden_inputs(granite.ours)
    _, w_ref, i_ref = granite.hf.model.layers[0].block_sparse_moe.router(x)
    w, i = granite.ours.blocks[0].ffn.route(x)
    assert torch.equal(i, i_ref) and torch.allclose(w, w_ref, atol=1e-6)
    _, w_ref, i_ref = nemotron.hf.model.layers[1].mixer.gate(x)
    w, i = nemotron.ours.blocks[1].mixer.route(x)
    order, order_ref = i.sort(dim=-1), i_ref.sort(dim=-1)
    assert torch.equal(order.values, order_ref.values)
    assert torch.allclose(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices), atol=1e-6)


def test_nemotron_routing_details_matter(moe):
    """The score-correction bias, the group restriction, the renormalisation and the scaling
    each change which experts are chosen or how much they weigh, so a model that skipped one
    would fail the logits comparisons above."""
    mixer = moe[Arch.NEMOTRON_H].ours.blocks[1].mixer
    x = _hidden_inputs(moe[Arch.NEMOTRON_H].ours)
    w, i = mixer.route(x)
    saved_bias, saved_shape = mixer.score_bias.data.clone(), mixer.shape
    try:
        mixer.score_bias.data.zero_()
        assert not torch.equal(mixer.route(x)[1].sort().values, i.sort().values)
        mixer.score_bias.data.copy_(saved_bias)
        mixer.shape = saved_shape.__class__(**{**saved_shape.__dict__, "n_group": 1, "topk_group": 1})
        assert not torch.equal(mixer.route(x)[1].sort().values, i.sort().values)
        mixer.shape = saved_shape.__class__(**{**saved_shape.__dict__, "norm_topk_prob": False, "scaling": 1.0})
        assert not torch.allclose(mixer.route(x)[0], w, atol=1e-3)
    finally:
        mixer.score_bias.data.copy_(saved_bias)
        mixer.shape = saved_shape
    # Tokens of one batch go to several experts, and every expert is used by some token.
    assert len(set(i.flatten().tolist())) == mixer.shape.n_experts


def test_experts_matter_to_the_logits(moe):
    """Dropping the routed experts (shared expert only) moves the logits far beyond LOGIT_TOL."""
    ckpt = moe[Arch.GRANITEMOEHYBRID]
    ids = prompt_of(20, seed=9)
    ref = hf_logits(ckpt, ids)
    model = ckpt.ours
    saved = [m.experts_down.data.clone() for m in _moes(model)]
    try:
        for m in _moes(model):
            m.experts_down.data.zero_()
        diff = float(((our_logits(model, ids) - ref) / ref.std()).abs().max())
    finally:
        for m, w in zip(_moes(model), saved):
            m.experts_down.data.copy_(w)
    assert diff > 100 * 1e-4


def test_missing_expert_is_reported(moe, tmp_path):
    from safetensors.torch import load_file, save_file

    from workers.errors import CheckpointError
    from workers.model.loader import load_model

    copy = tmp_path / "m"
    shutil.copytree(moe[Arch.NEMOTRON_H].path, copy)
    tensors = load_file(copy / "model.safetensors")
    del tensors["backbone.layers.1.mixer.experts.0.up_proj.weight"]
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts_up"):
        load_model(copy)
