"""Weight matmuls on measured backends (`workers.kernels.linear_tuning`) against plain F.linear.

Layer level: each packed backend (oneDNN, the panel kernel) equals F.linear within fp32
tolerance for 1..300 rows, with and without bias, 2-D, 3-D and strided inputs, on shapes that
fill panels exactly and partly, and each call goes to its bucket's backend.
Model level: installing and removing a plan keeps the very same parameters (the verifier
and the checkpoint see nothing else), and the engine on packed weights gives the same greedy
tokens and logits within tolerance as the reference path, through prefills and decodes of
different batch sizes. Tuning: only the blocks' linears (not the LM head), one shape's packed
copies at a time within `pass_bytes`, and the total budget ends even a single long bucket.
"""

from __future__ import annotations

import logging
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.engine.conftest import LogitRecorder, assert_logits_close, new_engine, our_logits, prompt_of, run_engine
from tests.families import ARCHS
from workers.cache.layout import layouts_for
from workers.checkpoint import Arch
from workers.kernels import huge_pages, linear_tuning, tuned_linear
from workers.kernels.linear_backends import (
    LinearBackend,
    available_backends,
    bind,
    pack_for,
    pack_weight,
    packed_linear,
    packing_available,
    run_packed,
)
from workers.kernels.extensions import panel_kernels
from workers.kernels.linear_plan import LinearKey, LinearPlan, LinearTuning
from workers.kernels.linear_tuning import choose, tune_linears
from workers.kernels.tuned_linear import TunedLinear
from workers.runner import ModelRunner
from workers.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")
PACKED, PANELS, TORCH = LinearBackend.ONEDNN_PACKED, LinearBackend.PANELS, LinearBackend.TORCH
# The panel kernel builds with the machine's compiler (always there in CI); the test fails
# rather than skips if it cannot be built, so a broken kernel source cannot pass unnoticed.
PACKED_BACKENDS = pytest.mark.parametrize("backend", [PACKED, PANELS], ids=lambda b: b.value)


def test_every_backend_is_available_here():
    assert panel_kernels() is not None, "the panel GEMM kernel did not build"
    assert available_backends() == (TORCH, PACKED, PANELS)


def _linear(out_features: int, in_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)


@PACKED_BACKENDS
@pytest.mark.parametrize("out_features", [96, 100])  # 6 full panels of 16; 6 and a part of 4
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 13, 40, 300])  # panel row groups of 6: 1, 2 and 3 groups
def test_packed_linear_equals_reference(backend, out_features, bias, rows):
    linear = _linear(out_features, 80, bias, seed=rows)
    tuning = LinearTuning()
    tuned = TunedLinear(linear, (backend,) * len(tuning.buckets), tuning)
    x = torch.randn(rows, 80) * 2
    assert tuned.backend_for(rows) is backend
    torch.testing.assert_close(tuned(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)
    x3 = x.view(1, rows, 80)  # leading dimensions are rows too
    torch.testing.assert_close(tuned(x3), F.linear(x3, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)
    strided = torch.randn(rows, 160)[:, ::2]  # a column slice: not contiguous
    torch.testing.assert_close(tuned(strided), F.linear(strided, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("in_features", [200, 2100])
def test_panel_kernel_gives_each_row_the_same_bits_at_any_batch(dtype, in_features):
    """A row's outputs do not depend on which rows share its call: at 1-16 rows the kernel
    takes the panel in k-blocks across row groups, beyond that group by group, up to 48 rows in
    one row block, beyond 48 fp32 rows as a blocked GEMM on strips of 6 rows (K over 2,048 in
    k-spans, the tile stored and reloaded between them; int8 in more row blocks), but every
    output sums its k in the same order. K = 200 ends in a part block; N = 40 in a part panel,
    and 49, 61 and 100 rows in a part strip. Bias rides along: it is added after the sum."""
    ext = panel_kernels()
    assert ext is not None, "the panel GEMM kernel did not build"
    torch.manual_seed(5)
    weight = torch.randn(40, in_features)
    bias = torch.randn(40)
    scales = None
    if dtype is torch.int8:
        scales = torch.rand(40) + 0.5
        weight = torch.randint(-127, 128, (40, in_features), dtype=torch.int8)
    panels = ext.pack_panels(weight)
    x = torch.randn(100, in_features)
    alone = torch.cat([ext.panel_linear(x[r : r + 1], panels, 40, bias, scales) for r in range(100)])
    for rows in (2, 6, 7, 8, 13, 16, 17, 30, 48, 49, 61, 100):
        together = ext.panel_linear(x[:rows], panels, 40, bias, scales)
        assert torch.equal(together, alone[:rows]), rows
    if scales is None:
        torch.testing.assert_close(alone, F.linear(x, weight, bias), rtol=1e-5, atol=1e-3)
    else:  # int8 values up to 127: sums of ~1e3, scaled after the sum here, before it in the reference
        torch.testing.assert_close(alone, F.linear(x, weight.float() * scales[:, None], bias), rtol=1e-5, atol=1e-1)


def test_panel_kernel_rejects_what_it_cannot_multiply():
    """Wrong widths, dtypes or panel counts are errors, never a read past the weight."""
    linear = _linear(40, 24, True, seed=3)
    panels = pack_for(PANELS, linear.weight)
    assert panels.shape == (3, 24, 16) and torch.all(panels[2, :, 8:] == 0)  # 40 = 2 full panels + 8 columns
    with pytest.raises(RuntimeError, match="features"):
        run_packed(PANELS, torch.randn(2, 25), panels, linear.bias, 40)
    with pytest.raises(RuntimeError, match="fp32"):
        run_packed(PANELS, torch.randn(2, 24, dtype=torch.float64), panels, linear.bias, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        run_packed(PANELS, torch.randn(2, 24), panels, None, 64)
    with pytest.raises(RuntimeError, match="empty weight"):
        run_packed(PANELS, torch.randn(2, 0), pack_for(PANELS, torch.randn(40, 0)), None, 40)


def test_each_call_runs_its_buckets_backend():
    """PANELS for 1 row, oneDNN for 2, TORCH for 3-4, oneDNN beyond 4 (the last bucket); one
    packed copy per packed backend."""
    linear = _linear(64, 48, True, seed=0)
    tuning = LinearTuning(buckets=(1, 2, 4, 8))
    tuned = TunedLinear(linear, (PANELS, PACKED, TORCH, PACKED), tuning)
    assert set(tuned.packs) == {PANELS, PACKED}
    packed, panels = pack_weight(linear.weight), pack_for(PANELS, linear.weight)
    expected_of = {
        TORCH: lambda x: F.linear(x, linear.weight, linear.bias),
        PACKED: lambda x: packed_linear(x, packed, linear.bias),
        PANELS: lambda x: run_packed(PANELS, x, panels, linear.bias, 64),
    }
    cases = [(1, PANELS), (2, PACKED), (3, TORCH), (4, TORCH), (5, PACKED), (8, PACKED), (100, PACKED)]
    for rows, backend in cases:
        x = torch.randn(rows, 48)
        assert tuned.backend_for(rows) is backend
        assert torch.equal(tuned(x), expected_of[backend](x)), rows
    assert tuned(torch.randn(0, 48)).shape == (0, 64)  # an empty batch is F.linear's


def test_the_choice_needs_a_margin_over_the_reference_and_over_a_held_copy():
    """`choose`: a packed backend beats F.linear by min_gain or F.linear stays; and a shape that
    already holds one packed copy switches to another only for a min_gain speed-up (each
    packed backend costs a copy of the weights), and never picks one min_gain slower than the
    fastest."""
    t = {TORCH: 100.0, PACKED: 90.0, PANELS: 60.0}
    assert choose(t, None, 1.05) is PANELS
    assert choose({TORCH: 100.0, PACKED: 97.0, PANELS: 98.0}, None, 1.05) is TORCH  # 3% is noise
    assert choose({TORCH: 100.0, PACKED: 62.0, PANELS: 60.0}, PACKED, 1.05) is PACKED  # keep the held copy
    assert choose({TORCH: 100.0, PACKED: 70.0, PANELS: 60.0}, PACKED, 1.05) is PANELS  # 17% earns a 2nd copy
    assert choose({TORCH: 100.0, PACKED: 99.0, PANELS: 60.0}, PACKED, 1.05) is PANELS
    assert choose({TORCH: 100.0}, None, 1.05) is TORCH
    # Never min_gain slower than the fastest: F.linear within 5% of the held copy, which is
    # within 5% of the fastest, used to win although it was 8.5% slower than the fastest
    # (the tuner's own timings of a 3072x512 weight at 1,024 rows).
    assert choose({TORCH: 24523.0, PACKED: 22591.0, PANELS: 23604.0}, PANELS, 1.05) is PANELS
    assert choose({TORCH: 101.0, PACKED: 98.0, PANELS: 99.0}, PANELS, 1.05) is PANELS  # both free: the faster


def test_bucket_index_and_validation():
    tuning = LinearTuning(buckets=(1, 2, 4, 8))
    assert [tuning.bucket_index(r) for r in (1, 2, 3, 4, 5, 8, 9, 1000)] == [0, 1, 2, 2, 3, 3, 3, 3]
    for bad in [dict(buckets=()), dict(buckets=(2, 4)), dict(buckets=(1, 4, 4)), dict(buckets=(1, 8, 4)),
                dict(samples=0), dict(min_gain=0.9), dict(bucket_budget_s=0.0), dict(total_budget_s=0.0),
                dict(pass_rows=-1), dict(pass_bytes=0)]:  # fmt: skip
        with pytest.raises(ValueError):
            LinearTuning(**bad)
    with pytest.raises(ValueError):
        LinearPlan(tuning, {LinearKey(4, 4, False, torch.float32): (TORCH,) * 3})


def test_tuning_measures_every_fp32_shape_and_respects_the_margin():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32, bias=False), nn.Linear(32, 64), nn.Linear(32, 16))
    model[3].to(torch.bfloat16)  # not tuned: keeps the reference without being timed
    tuning = LinearTuning(buckets=(1, 4, 32), samples=3)
    plan = tune_linears(model, tuning)
    keys = {LinearKey.of(m) for m in model}
    assert set(plan.choices) == keys and len(keys) == 3
    bf16 = LinearKey.of(model[3])
    assert plan.choices[bf16] == (TORCH,) * 3 and bf16 not in plan.timings_us
    for key in keys - {bf16}:
        assert all(t[b] > 0 for t in plan.timings_us[key] for b in (TORCH, PACKED, PANELS))
    # Nothing beats F.linear by a factor of a million: the margin keeps the reference.
    strict = tune_linears(model, LinearTuning(buckets=(1, 4, 32), samples=3, min_gain=1e6))
    assert all(c == (TORCH,) * 3 for c in strict.choices.values())
    # Out of time before the first bucket: nothing is timed and the reference stays.
    hurried = tune_linears(model, LinearTuning(buckets=(1, 4, 32), samples=3, total_budget_s=1e-9))
    assert all(c == (TORCH,) * 3 for c in hurried.choices.values())
    assert all(t == ({}, {}, {}) for t in hurried.timings_us.values())


def test_a_plan_says_which_buckets_went_untimed(caplog):
    """A start-up that runs out of its tuning budget leaves buckets on a guess; the plan and the
    log say which, and a fully timed plan says none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32, bias=False))
    timed = tune_linears(model, LinearTuning(buckets=(1, 4), samples=3))
    assert timed.unmeasured() == {} and not any("?" in line for line in timed.describe())
    with caplog.at_level(logging.WARNING, logger="workers.kernels.linear_tuning"):
        hurried = tune_linears(model, LinearTuning(buckets=(1, 4), samples=3, total_budget_s=1e-9))
    assert hurried.unmeasured() == {LinearKey.of(m): (1, 4) for m in model}
    assert all(line.endswith("1:TORCH? 4:TORCH?") for line in hurried.describe())
    assert "2 of 2 shapes have untimed buckets" in caplog.text


def test_prefill_chunks_dispatch_on_a_bucket_measured_at_prefill_size():
    """Decode batches and prefill chunks are different matmuls (memory- vs compute-bound) and
    their fastest backends differ: chunks beyond 256 rows, up to the step's 2,048-token budget,
    run on a bucket of their own, which the tuner times on every backend, and not on the
    256-row bucket's choice."""
    tuning = LinearTuning()
    last = len(tuning.buckets) - 1
    assert tuning.buckets[last] >= 1024 and tuning.bucket_index(256) == last - 1
    assert tuning.bucket_index(257) == tuning.bucket_index(2048) == last
    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    plan = tune_linears(nn.Sequential(linear), tuning)
    timed = plan.timings_us[LinearKey.of(linear)][last]
    assert set(timed) == {TORCH, PACKED, PANELS} and all(t > 0 for t in timed.values())
    tuned = TunedLinear(linear, (PANELS,) * last + (PACKED,), tuning)
    packed = pack_weight(linear.weight)
    for rows, expected in [(256, lambda x: run_packed(PANELS, x, pack_for(PANELS, linear.weight), linear.bias, 48)),
                           (600, lambda x: packed_linear(x, packed, linear.bias))]:  # fmt: skip
        x = torch.randn(rows, 32)
        assert torch.equal(tuned(x), expected(x)), rows


def test_install_and_remove_keep_the_same_parameters(tiny):
    model = tiny[Arch.GRANITEMOEHYBRID].ours
    before = dict(model.named_parameters())
    try:
        model.use_linear_plan(LinearPlan.fixed(model, PACKED))
        model.use_linear_plan(LinearPlan.fixed(model, PACKED))  # replaces, never wraps twice
        tuned = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
        assert tuned and all(type(m) is TunedLinear and set(m.packs) == {PACKED} for m in tuned)
        assert type(model.lm_head) is nn.Linear  # compute_logits never calls it as a module
        assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in before.items()}
    finally:
        model.use_linear_plan(None)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in before.items()}


@PACKED_BACKENDS
@ARCHS
def test_packed_model_logits_equal_reference(tiny, arch, backend, monkeypatch):
    """Prefill 20 then decode one token at a time, every position's logits: packed vs F.linear."""
    model = tiny[arch].ours
    ids = prompt_of(30, seed=7)
    split = [20] + [1] * 10
    reference = our_logits(model, ids, split, fast_kernels=False)
    calls = []

    def counted_bind(b, weight, packed, bias, out_features):
        fn, args = bind(b, weight, packed, bias, out_features)

        def counted(x, *args):
            calls.append((b, x.shape[0]))
            return fn(x, *args)

        return counted, args

    monkeypatch.setattr(tuned_linear, "bind", counted_bind)
    packed = our_logits(model, ids, split, linear_plan=LinearPlan.fixed(model, backend))
    assert (backend, 20) in calls and (backend, 1) in calls  # the prefill and the decodes ran packed
    assert_logits_close(packed, reference)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # restored


@PACKED_BACKENDS
@ARCHS
def test_engine_on_packed_weights_equals_reference(tiny, arch, backend):
    """Requests of different lengths: prefill batches and decode batches of 6 down to 1 rows."""
    prompts = {f"r{i}": prompt_of(4 + 9 * i, seed=i) for i in range(6)}
    params = {rid: SamplingParams(max_tokens=2 + 3 * i, temperature=0.0, ignore_eos=True)
              for i, rid in enumerate(prompts)}  # fmt: skip
    runs, recorders = [], []
    for plan in (LinearPlan.fixed(tiny[arch].ours, backend), None):
        engine = new_engine(tiny[arch].path)
        if plan is None:
            engine.runner.set_fast_kernels(False)
        else:
            engine.runner.set_fast_kernels(True, plan)
            assert engine.runner.linear_plan is plan
        recorders.append(LogitRecorder(engine))
        runs.append(run_engine(engine, prompts, params))
    assert runs[0].tokens == runs[1].tokens
    for rid in prompts:
        assert_logits_close(recorders[0].stacked(rid), recorders[1].stacked(rid))


def test_the_lm_head_is_neither_tuned_nor_packed(tiny):
    """`compute_logits` multiplies the LM head's weight itself: timing or packing it would spend
    start-up time and a copy of the largest weight for nothing."""
    model = tiny[Arch.GRANITEMOEHYBRID].ours
    head = LinearKey.of(model.lm_head)
    assert all(LinearKey.of(m) != head for m in model.blocks.modules() if isinstance(m, nn.Linear))
    kv, state = layouts_for(model.config, 8, 16, 3, torch.float32)
    runner = ModelRunner(model, kv, state, "cpu", fast_kernels=True)
    try:
        assert runner.linear_plan.choices and head not in runner.linear_plan.choices
        assert type(model.lm_head) is nn.Linear
    finally:
        runner.set_fast_kernels(False)


def test_tuning_packs_one_shape_at_a_time_within_pass_bytes(monkeypatch):
    """Measuring holds the packed copies of one shape at a time, at most `pass_bytes` of them per
    packed backend, and frees them before returning; every bucket of every shape is still measured."""
    torch.manual_seed(1)
    model = nn.Sequential(*(nn.Linear(40, 72) for _ in range(5)), *(nn.Linear(72, 40) for _ in range(5)))
    live, peak = {PACKED: 0, PANELS: 0}, {PACKED: 0, PANELS: 0}

    def tracked(backend, weight):
        packed = pack_for(backend, weight)
        live[backend] += 1
        peak[backend] = max(peak[backend], live[backend])
        weakref.finalize(packed, lambda: live.__setitem__(backend, live[backend] - 1))
        return packed

    monkeypatch.setattr(linear_tuning, "pack_for", tracked)
    plan = tune_linears(model, LinearTuning(buckets=(1, 4, 32), samples=3, pass_bytes=2 * 40 * 72 * 4))
    assert peak == {PACKED: 2, PANELS: 2} and live == {PACKED: 0, PANELS: 0}
    assert len(plan.timings_us) == 2 and all(t for per_bucket in plan.timings_us.values() for t in per_bucket)


def test_tuning_stops_inside_a_bucket_at_the_total_budget():
    """A bucket allowed a million samples and a thousand seconds: the total budget still ends the
    measuring (checked between timed calls, not only between buckets), each shape measured."""
    model = nn.Sequential(nn.Linear(56, 24), nn.Linear(24, 56))
    tuning = LinearTuning(buckets=(1,), samples=10**6, bucket_budget_s=1e3, total_budget_s=0.3)
    start = time.perf_counter()
    plan = tune_linears(model, tuning)
    assert time.perf_counter() - start < 3.0
    assert len(plan.timings_us) == 2 and all(t[0] for t in plan.timings_us.values())


def _advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding `address` was advised MADV_HUGEPAGE ("hg" in its VmFlags)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header: start-end perms ...
                start, end = (int(v, 16) for v in first.split("-"))
                inside = start <= address < end
            elif inside and first == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


HUGE_PAGES = pytest.mark.skipif(not huge_pages.can_advise(), reason="no madvise(MADV_HUGEPAGE) on this OS")


@HUGE_PAGES
def test_tuned_weights_and_panels_are_copied_onto_huge_pages(tiny):
    model = tiny[Arch.GRANITEMOEHYBRID].ours
    before = {id(p): p.detach().clone() for p in model.blocks.parameters()}  # installing keeps the Parameters
    assert not _advised_for_huge_pages(torch.randn(1 << 20).data_ptr())  # torch's allocator: not advised
    try:
        model.use_linear_plan(LinearPlan.fixed(model, PANELS))
        tuned = [m for m in model.blocks.modules() if isinstance(m, TunedLinear)]
        assert tuned
        for m in tuned:
            assert _advised_for_huge_pages(m.weight.data_ptr())
            assert _advised_for_huge_pages(m.packs[PANELS].data_ptr())
            x = torch.randn(5, m.in_features)  # the bound calls read the copies, bit for bit
            expected = run_packed(PANELS, x, pack_for(PANELS, before[id(m.weight)]), m.bias, m.out_features)
            assert torch.equal(m(x), expected)
        assert all(torch.equal(p, before[id(p)]) for p in model.blocks.parameters())
    finally:
        model.use_linear_plan(None)


@HUGE_PAGES
def test_huge_page_copies_are_exact_and_aligned():
    # fp32, bf16, int8 (the int8 mode's panels), and a transposed view (comes back contiguous)
    tensors = [torch.randn(300, 7), torch.randn(5, dtype=torch.bfloat16),
               torch.randint(-127, 127, (3, 1000), dtype=torch.int8), torch.randn(64, 32).t()]  # fmt: skip
    copies = huge_pages.on_huge_pages(tensors)
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.is_contiguous() and c.data_ptr() % 4096 == 0
        assert _advised_for_huge_pages(c.data_ptr())
    with pytest.raises(ValueError, match="dense CPU tensors"):
        huge_pages.on_huge_pages([pack_weight(torch.randn(16, 16))])  # oneDNN's opaque layout
