"""The decode program (`workers/model/decode_program.py`) against the module forward it stands
in for (`HybridLM.forward_layers`): the same bits of hidden states and of every cache tensor,
step after step of a running engine, on all three families and each weight-matmul backend;
everything but a pure decode step stays on the modules."""

from __future__ import annotations

import time

import pytest
import torch

from tests.engine.conftest import new_engine, prompt_of
from workers.checkpoint import Arch
from workers.kernels.linear_backends import LinearBackend, available_backends
from workers.kernels.linear_plan import LinearPlan
from workers.model.config import MixerKind
from workers.model.forward_batch import ModelCaches
from workers.model.hybrid_lm import HybridLM
from workers.request import KeepState
from workers.sampling import SamplingParams


class ProgramChecker:
    """Stands in for `model.forward`: a step the decode program accepts runs on it and on the
    module forward over a copy of the caches, and both must give the same bits."""

    def __init__(self, model: HybridLM):
        self.model = model
        self.program_steps = self.mixed_steps = self.snapshot_steps = self.scattered_steps = 0
        model.forward = self.forward  # nn.Module.__call__ looks up `forward` on the instance first

    def forward(self, batch, caches: ModelCaches) -> torch.Tensor:
        program = self.model.decode_program()
        if program is None or not program.accepts(batch, caches):
            self.mixed_steps += batch.decode is not None and bool(batch.prefills)
            return self.model.forward_layers(batch, caches)
        copy = ModelCaches(*([t.clone() for t in ts] for ts in (caches.kv, caches.conv, caches.ssm)))
        expected = self.model.forward_layers(batch, copy)
        hidden = program.run(batch, caches)
        assert torch.equal(hidden, expected)
        for name in ("kv", "conv", "ssm"):
            for i, (ours, ref) in enumerate(zip(getattr(caches, name), getattr(copy, name))):
                assert torch.equal(ours, ref), f"{name}[{i}]"
        self.program_steps += 1
        self.snapshot_steps += batch.decode.snapshot_rows is not None
        self.scattered_steps += batch.decode.slot_run is None
        return hidden


def _backends() -> list[LinearBackend | None]:
    """None: the plan measured at start-up; then each backend alone (the int8 panels have
    their own tests: they share the panels' call)."""
    return [None] + [b for b in available_backends()]


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: "measured" if b is None else b.value)
@pytest.mark.parametrize("arch", list(Arch))
def test_decode_program_gives_the_module_forwards_bits(tiny, arch, backend):
    """Histories cross blocks of 4, prompts are chunked beside running decodes (those mixed
    steps stay on the modules), requests end at different steps (scattered slots), and kept
    requests snapshot their Mamba state at aligned positions during decode."""
    engine = new_engine(tiny[arch].path, block_size=4, max_num_batched_tokens=12)
    model = engine.runner.model
    if backend is not None:
        engine.runner.set_fast_kernels(True, LinearPlan.fixed(model.blocks, backend))
    checker = ProgramChecker(model)
    for i, n in enumerate([3, 9, 17, 4, 12, 6]):
        params = SamplingParams(max_tokens=4 + 3 * (i % 3), temperature=0.0, ignore_eos=True)
        keep = KeepState.PREPARE if i % 2 else KeepState.FREE
        engine.add_request(f"r{i}", prompt_of(n, seed=20 + i), params, keep=keep)
        engine.step()  # later prompts arrive while earlier ones decode
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert checker.program_steps >= 5 and checker.mixed_steps >= 1
    assert checker.snapshot_steps >= 1 and checker.scattered_steps >= 1
    engine.caches.heads.expire(time.monotonic() + engine.config.cache.prepared_turn_timeout_s + 1)


def test_the_program_follows_the_fast_path_the_plan_and_the_parameters(tiny):
    """Switching the path or the plan drops the program (the reference path has none); it reads
    the modules' own parameters, so an update in place shows in its next step."""
    engine = new_engine(tiny[Arch.BAMBA].path, block_size=4)
    model = engine.runner.model
    first = model.decode_program()
    assert first is not None and model.decode_program() is first
    engine.runner.set_fast_kernels(False)
    assert model.decode_program() is None
    engine.runner.set_fast_kernels(True, LinearPlan.fixed(model.blocks, LinearBackend.TORCH))
    assert model.decode_program() not in (None, first)

    checker = ProgramChecker(model)
    engine.add_request("a", prompt_of(7, seed=1), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    mamba = next(b.mixer for b in model.blocks if b.kind is MixerKind.MAMBA)
    with torch.no_grad():
        model.final_norm.weight.mul_(1.5)
        mamba.norm.weight.mul_(0.5)
        mamba.in_proj.weight.mul_(2.0)  # the TORCH plan multiplies the weight as loaded
    while engine.has_unfinished():
        engine.step()
    assert checker.program_steps >= 5
