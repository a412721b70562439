"""Rollback: injected mismatches change nothing that is committed or streamed, and the state
a rollback leaves is the state at the accepted position."""

from __future__ import annotations

import pytest
import torch

from tests.determinism.helpers import DET_PROMPTS, background_load, capture_states, det_arrivals, drive, new_engine
from workers.state_names import Holder
from workers.cache.layout import allocate_caches
from workers.checkpoint import Arch
from workers.request import Request
from workers.runner import ModelRunner
from workers.sampling import SamplingParams
from workers.scheduler import ScheduledChunk


def _run(model_dir, rate: float, load_seed: int | None):
    engine = new_engine(model_dir, mismatch_rate=rate, mismatch_seed=3)
    capture = capture_states(engine)
    load = background_load(load_seed, max_requests=12) if load_seed is not None else []
    outcome = drive(engine, det_arrivals(retain=True) + load)
    return outcome, capture, engine.verifier.metrics


@pytest.mark.parametrize("arch", [Arch.BAMBA, Arch.GRANITEMOEHYBRID], ids=lambda a: a.value)
def test_injected_mismatches_leave_outputs_kv_and_mamba_bytes_unchanged(det_models, arch):
    base, base_state, base_metrics = _run(det_models[arch], 0.0, None)
    assert base_metrics.rollbacks == 0 and base_metrics.injected_mismatches == 0
    assert set(base_state.kv) == set(DET_PROMPTS)
    for rate, load in ((0.1, 4), (0.5, 9)):
        outcome, state, metrics = _run(det_models[arch], rate, load)
        assert outcome.of(DET_PROMPTS) == base.of(DET_PROMPTS), rate
        assert not outcome.unverified_streamed
        assert state.lengths == base_state.lengths
        assert state.kv == base_state.kv, f"KV bytes differ after rollbacks at {rate}"
        assert state.slots == base_state.slots, f"Mamba state bytes differ after rollbacks at {rate}"
        # Every rollback came from an injection (a wrongly restored state would add more).
        assert 0 < metrics.rollbacks <= metrics.injected_mismatches
        assert metrics.tokens_redone >= metrics.rollbacks


def _reference_state(model, tokens: list[int], kv_layout, state_layout):
    """Our fast path's prefill of `tokens` into fresh caches: (KV rows, conv, ssm) per layer."""
    caches = allocate_caches(kv_layout, state_layout, "cpu")
    runner = ModelRunner(model, kv_layout, state_layout, "cpu")
    runner.caches = caches
    bs = kv_layout.block_size
    table = list(range(1, -(-len(tokens) // bs) + 1))
    request = Request("ref", list(tokens), SamplingParams(max_tokens=1, temperature=0.0))
    batch, _ = runner.build_batch([ScheduledChunk(request, 0, len(tokens), table, state_slot=0)])
    with torch.inference_mode():
        model(batch, caches)
    pos = torch.arange(len(tokens))
    flat = torch.tensor(table)[pos // bs] * bs + pos % bs
    kv = [c.flatten(1, 2)[:, flat].clone() for c in caches.kv]
    return kv, [c[0].clone() for c in caches.conv], [s[0].clone() for s in caches.ssm]


def test_a_rollback_restores_kv_and_mamba_state_at_the_accepted_position(det_models):
    """Checked right after each commit that rolled back mid-tile: the request's KV of
    [0, a) and its running Mamba state equal a plain prefill of its verified tokens."""
    engine = new_engine(det_models[Arch.NEMOTRON_H], mismatch_rate=0.3, mismatch_seed=5)
    inner = engine.verifier.commit
    checked = []
    bs = engine.kv_layout.block_size

    def commit(verdicts, kept):
        inner(verdicts, kept)
        for verdict in verdicts:
            request = verdict.request
            a = request.num_computed_tokens
            if not verdict.mismatch or a % engine.config.deterministic.window == 0:
                continue
            kv_ref, conv_ref, ssm_ref = _reference_state(
                engine.model, request.token_ids[:a], engine.kv_layout, engine.state_layout
            )
            holder = Holder.request(request.request_id)
            table = torch.tensor(engine.caches.kv.table(holder))
            pos = torch.arange(a)
            flat = table[pos // bs] * bs + pos % bs
            slot = engine.caches.states.slot_of(holder)
            for cache, ref in zip(engine.runner.caches.kv, kv_ref):
                torch.testing.assert_close(cache.flatten(1, 2)[:, flat], ref, atol=2e-5, rtol=1e-4)
            for cache, ref in zip(engine.runner.caches.conv, conv_ref):
                torch.testing.assert_close(cache[slot], ref, atol=2e-5, rtol=1e-4)
            for cache, ref in zip(engine.runner.caches.ssm, ssm_ref):
                torch.testing.assert_close(cache[slot], ref, atol=2e-5, rtol=1e-4)
            checked.append(a)

    engine.verifier.commit = commit
    drive(engine, det_arrivals())
    assert len(checked) >= 3 and len({a % 16 for a in checked}) >= 2, checked
