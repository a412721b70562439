"""Weight-only int8 (`EngineConfig.weight_quantization=INT8`, `linear_plan.int8_plan`).

What it promises, each checked here:
- quantization: per output channel, every weight within half a step of its int8 value, the
  largest of each row exact;
- the kernel multiplies exactly the dequantized weights (int8 panels = F.linear on
  scale * q, within fp32 rounding), for one row group and for the widened many-row path;
- the model on int8 panels equals the fp32 reference model whose weights are the
  dequantized ones: the only difference from fp32 is the quantization itself;
- an int8 engine keeps fp32 where it promises to: the reference path and deterministic
  requests (verified by fp32 tiles) give the very tokens of an fp32 engine, and its
  identity differs, so heads never move between int8 and fp32 engines.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.engine.conftest import LOGIT_TOL, assert_logits_close, new_engine, our_logits, prompt_of, run_engine
from tests.families import ARCHS
from workers.checkpoint import Arch
from workers.config import EngineConfig, WeightQuantization
from workers.kernels.linear_backends import LinearBackend, pack_for, quantize_int8, run_packed
from workers.kernels.linear_plan import LinearKey, LinearPlan, int8_plan
from workers.sampling import SamplingParams

INT8 = LinearBackend.PANELS_INT8


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8(weight)
    return q.float() * scale[:, None]


def test_quantization_is_per_channel_and_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(37, 50) * torch.logspace(-3, 0, 37)[:, None]  # rows of very different ranges
    w[5] = 0.0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (37,)
    assert scale[5] == 0 and torch.all(q[5] == 0)
    deq = q.float() * scale[:, None]
    assert torch.all((deq - w).abs() <= scale[:, None] / 2 + 1e-7)
    rows = torch.arange(37)
    biggest = w.abs().argmax(dim=1)
    torch.testing.assert_close(deq[rows, biggest], w[rows, biggest], rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", [1, 4, 6, 7, 13, 64])  # direct int8 groups; beyond 6: widened panels
@pytest.mark.parametrize("bias", [False, True])
def test_int8_panels_multiply_the_dequantized_weight(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(72, 100, bias=bias).requires_grad_(False)  # 100 = 6 panels + 4 columns
    packed = pack_for(INT8, linear.weight)
    x = torch.randn(rows, 72)
    got = run_packed(INT8, x, packed, linear.bias, 100)
    torch.testing.assert_close(got, F.linear(x, _dequantized(linear.weight), linear.bias), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, F.linear(x, linear.weight, linear.bias), rtol=1e-6, atol=1e-6)  # it is int8
    with pytest.raises(RuntimeError, match="scales"):
        run_packed(LinearBackend.PANELS, x, packed[0], linear.bias, 100)  # int8 panels without their scales


@ARCHS
def test_int8_model_equals_the_reference_on_dequantized_weights(tiny, arch):
    """Prefill 20, then decodes: the int8 fast path against the fp32 reference model holding
    scale * q; and against the fp32 weights, an error of the quantization's size, not zero."""
    model = tiny[arch].ours
    ids = prompt_of(30, seed=3)
    split = [20] + [1] * 10
    plan = int8_plan(model.blocks, max_rows=None)
    assert {c for per_bucket in plan.choices.values() for c in per_bucket} == {INT8}
    int8 = our_logits(model, ids, split, linear_plan=plan)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for m in twin.blocks.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(_dequantized(m.weight))
    assert_logits_close(int8, our_logits(twin, ids, split, fast_kernels=False))
    fp32 = our_logits(model, ids, split, fast_kernels=False)
    scaled = float(((int8 - fp32) / fp32.std()).abs().max())
    # Random tiny weights have no structure to spare: measured 0.10-0.28 of the logits' std
    # over these 30 positions. A lost or misplaced scale is off by orders of magnitude.
    assert 10 * LOGIT_TOL < scaled < 0.5, scaled


def test_an_int8_engine_keeps_fp32_where_it_promises(tiny):
    path = tiny[Arch.GRANITEMOEHYBRID].path
    fp32, int8 = new_engine(path), new_engine(path, weight_quantization=WeightQuantization.INT8)
    assert int8.identity != fp32.identity and "int8" in int8.identity.dtype
    blocks = [m for m in int8.model.blocks.modules() if isinstance(m, nn.Linear)]
    assert blocks and all(m.backend_for(r) is INT8 for m in blocks for r in (1, 8, 64))
    # Beyond INT8_MAX_ROWS (prompt chunks) the fp32 weights, on the backend tuned for them.
    assert all(m.backend_for(300) is int8.runner.linear_plan.choices[LinearKey.of(m)][-1] is not INT8 for m in blocks)
    assert type(int8.model.lm_head) is nn.Linear  # the LM head stays fp32
    prompts = {f"r{i}": prompt_of(9 + 7 * i, seed=i) for i in range(4)}
    # Deterministic requests are verified by fp32 tiles on the weights as loaded: the int8
    # engine answers them with the fp32 engine's very tokens (it only drafts on int8).
    det = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, deterministic=True)
    assert run_engine(int8, prompts, det).tokens == run_engine(fp32, prompts, det).tokens
    # The reference path multiplies the fp32 weights, untouched by the packing.
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    int8.runner.set_fast_kernels(False)
    fp32.runner.set_fast_kernels(False)
    assert run_engine(int8, prompts, greedy).tokens == run_engine(fp32, prompts, greedy).tokens
    int8.check_integrity()


def test_a_plan_must_match_the_engines_weight_quantization(tiny):
    """An int8 plan on an fp32 engine would compute int8 states under an fp32 identity; an fp32
    plan on an int8 engine would drop the mode: both are refused."""
    path = tiny[Arch.GRANITEMOEHYBRID].path
    fp32, int8 = new_engine(path), new_engine(path, weight_quantization=WeightQuantization.INT8)
    with pytest.raises(ValueError, match="int8 linear plan for weight_quantization=none"):
        fp32.runner.set_fast_kernels(True, int8_plan(fp32.model.blocks))
    with pytest.raises(ValueError, match="fp32 linear plan for weight_quantization=int8"):
        int8.runner.set_fast_kernels(True, LinearPlan.fixed(int8.model.blocks, LinearBackend.PANELS))


@pytest.mark.parametrize("backend", [LinearBackend.PANELS, INT8], ids=lambda b: b.value)
def test_every_row_gets_the_same_bits_at_any_batch_size(backend):
    """Row groups, widened int8 panels and blocks of rows change which rows run together, never
    a row's arithmetic: 100 rows in one call equal 100 one-row calls bit for bit."""
    torch.manual_seed(5)
    linear = nn.Linear(64, 40).requires_grad_(False)
    packed = pack_for(backend, linear.weight)
    x = torch.randn(100, 64)
    together = run_packed(backend, x, packed, linear.bias, 40)
    alone = torch.cat([run_packed(backend, x[i : i + 1], packed, linear.bias, 40) for i in range(100)])
    assert torch.equal(together, alone)


def test_a_weight_with_inf_or_nan_is_not_quantized():
    w = torch.randn(4, 8)
    w[2, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8(w)


def test_int8_needs_fp32_on_cpu():
    with pytest.raises(ValueError, match="fp32 CPU"):
        EngineConfig(model="m", dtype=torch.bfloat16, weight_quantization=WeightQuantization.INT8)
    with pytest.raises(ValueError):
        EngineConfig(model="m", weight_quantization="int4")
    assert EngineConfig(model="m", weight_quantization="int8").weight_quantization is WeightQuantization.INT8


def test_without_the_panel_kernel_tuning_skips_it_and_int8_is_refused(tiny, monkeypatch):
    """A machine that cannot build the kernel: tuning chooses among F.linear and oneDNN, and the
    int8 mode fails at start-up with the reason instead of silently running fp32."""
    from workers.kernels import linear_backends, linear_plan

    monkeypatch.setattr(linear_backends, "panel_kernels", lambda: None)
    monkeypatch.setattr(linear_plan, "panel_build_failure", lambda: "no c++ on PATH")
    assert LinearBackend.PANELS not in linear_backends.available_backends()
    with pytest.raises(RuntimeError, match="no c\\+\\+ on PATH"):
        int8_plan(tiny[Arch.BAMBA].ours.blocks)
