"""How the runner switches the model onto the fast path (`workers.kernels.fast_path`).

Both C++ kernel modules are built when the fast path is turned on, never inside a forward (a
build there would stall every request in flight on the engine thread). And each part of the
fast path stands on its own: with neither kernel buildable, the pure-torch fast variants
(split prefill attention, grouped SSD scan) still run, and still equal the reference.
"""

from __future__ import annotations

import torch

from tests.engine.conftest import assert_logits_close, our_logits, prompt_of
from tests.families import ARCHS
from workers import runner as runner_module
from workers.cache.layout import layouts_for
from workers.checkpoint import Arch
from workers.kernels import cpp_build
from workers.kernels.extensions import decode_kernels, scan_kernels
from workers.kernels.fast_path import REFERENCE, FastPath
from workers.kernels.linear_backends import LinearBackend
from workers.kernels.linear_plan import LinearPlan
from workers.model import mamba_mixer, ssd
from workers.model.attention import Attention
from workers.request import Request
from workers.runner import ModelRunner
from workers.sampling import SamplingParams
from workers.scheduler import ScheduledChunk


def test_kernels_are_built_at_start_up_not_in_a_forward(tiny, monkeypatch):
    model = tiny[Arch.BAMBA].ours
    kv, state = layouts_for(model.config, 8, 16, 3, torch.float32)
    plan = LinearPlan.fixed(model.blocks, LinearBackend.TORCH)
    runner = ModelRunner(model, kv, state, "cpu", fast_kernels=True, linear_plan=plan)
    holders = [m for m in model.modules() if hasattr(m, "fast")]
    try:
        assert runner.fast == FastPath(on=True, decode=decode_kernels(), scan=scan_kernels())
        assert holders and all(m.fast is runner.fast for m in holders)

        def no_build(*args, **kwargs):
            raise AssertionError("a kernel was built inside a forward")

        monkeypatch.setattr(cpp_build, "build_cpu_extension", no_build)
        monkeypatch.setattr(ssd, "scan_kernels", no_build, raising=False)
        request = Request("r", prompt_of(40, seed=2), SamplingParams(max_tokens=1, temperature=0.0))
        batch, _ = runner.build_batch([ScheduledChunk(request, 0, 40, [3, 4, 5], state_slot=1)])
        assert torch.isfinite(model.compute_logits(model(batch, runner.caches))).all()
    finally:
        runner.set_fast_kernels(False)
    assert all(m.fast is REFERENCE for m in holders)


@ARCHS
def test_fast_path_without_any_kernel_runs_its_pure_torch_parts(tiny, arch, monkeypatch):
    """No compiler: decode mixers, decode attention and norms run their references, while the
    split prefill attention and the grouped SSD scan (which need none) still run, equal to the
    one-shot reference path."""
    monkeypatch.setattr(runner_module, "decode_kernels", lambda: None)
    monkeypatch.setattr(runner_module, "scan_kernels", lambda: None)
    calls = {"split": 0, "grouped": 0, "reference_scan": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(Attention, "_prefill_split", counting("split", Attention._prefill_split))
    monkeypatch.setattr(mamba_mixer, "chunked_scan_grouped", counting("grouped", mamba_mixer.chunked_scan_grouped))
    monkeypatch.setattr(mamba_mixer, "chunked_scan", counting("reference_scan", mamba_mixer.chunked_scan))
    model, ids = tiny[arch].ours, prompt_of(60, seed=8)
    plan = LinearPlan.fixed(model.blocks, LinearBackend.TORCH)
    fast = our_logits(model, ids, chunks=[23, 17, 1, 19], linear_plan=plan)
    assert calls["split"] > 0 and calls["grouped"] > 0 and calls["reference_scan"] == 0
    ref = our_logits(model, ids, fast_kernels=False)
    assert calls["reference_scan"] > 0
    assert_logits_close(fast, ref)
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))
