"""What an engine reports for routing (`LLMEngine.load`): its queue in prompt tokens not yet
computed, the mean prompt, and the prefill speed it measured; the router prices requests with
these (deployments/routing/cost.py)."""

from __future__ import annotations

from tests.engine.conftest import new_engine, prompt_of
from workers.checkpoint import Arch
from workers.sampling import SamplingParams


def test_load_reports_waiting_prompt_tokens_then_the_measured_prefill_speed(tiny):
    engine = new_engine(tiny[Arch.BAMBA].path, max_num_batched_tokens=64)
    before = engine.load()
    assert (before.requests, before.waiting_prefill_tokens, before.prefill_tokens_per_s) == (0, 0, 0.0)
    params = SamplingParams(max_tokens=2)
    engine.add_request("a", prompt_of(100, seed=1), params)
    engine.add_request("b", prompt_of(60, seed=2), params)
    queued = engine.load()
    assert (queued.requests, queued.waiting_prefill_tokens) == (2, 160)
    assert queued.prefill_tokens_per_s == 0.0 and queued.mean_prefill_tokens == 0.0  # nothing ran yet
    engine.step()  # 64 prompt tokens of the budget: a admitted
    running = engine.load()
    assert running.waiting_prefill_tokens == 160 - 64 and running.mean_prefill_tokens == 100
    while engine.has_unfinished():
        engine.step()
    done = engine.load()
    assert done.requests == 0 and done.waiting_prefill_tokens == 0 and done.prefill_tokens_per_s > 0
    assert done.mean_prefill_tokens == 100 * 0.9 + 60 * 0.1  # b admitted after a
