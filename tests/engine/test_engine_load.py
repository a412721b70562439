"""What an engine reports for routing (`LLMEngine.load`): its queue in prompt tokens not yet
computed, the mean prompt, and the prefill speed it measured; the router prices requests with
these (deployments/routing/cost.py)."""

from __future__ import annotations

from tests.engine.conftest import GREEDY, new_engine, prompt_of
from workers.checkpoint import Arch
from workers.request import CheckpointMark, KeepState, ReuseSource
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


def test_a_request_waiting_for_a_prefix_another_computes_reports_only_its_own_tail(tiny):
    """Loops started together over one 40-token system prompt: the first prefills it, the second
    waits to attach its mark (prefix_wait.py). The router must not price the second's 40 tokens
    as queue: the replica computing them would look busy by the very prefix it is about to hold,
    and the next loop of the tenant would go elsewhere and compute it again."""
    engine = new_engine(tiny[Arch.BAMBA].path, max_num_batched_tokens=24)
    system = prompt_of(40, seed=15)
    mark = (CheckpointMark(40, label=1, source=ReuseSource.SYSTEM),)
    engine.add_request("a", system + prompt_of(20, seed=1), GREEDY, prefix_scope="one", marks=mark)
    engine.add_request("b", system + prompt_of(20, seed=2), GREEDY, prefix_scope="one", marks=mark)
    assert engine.load().waiting_prefill_tokens == 120  # nothing running: nobody computes it yet
    engine.step()  # a admitted, 24 of its 60 computed; b waits for a's mark at 40
    assert engine.load().waiting_prefill_tokens == (60 - 24) + 20


def test_a_queued_request_reports_only_what_its_held_prefix_leaves(tiny):
    """An agent loop's next step queued behind a running step: its prompt is the history the
    replica holds (the last step's end) and a tool result. It is no queue of that history: counted
    whole, the replica looked busy by the very history it holds and the router sent the loop's
    next step to recompute it elsewhere (bench.agent, step 2)."""
    engine = new_engine(tiny[Arch.BAMBA].path)
    history = prompt_of(50, seed=3)
    engine.add_request("a", history, GREEDY, prefix_scope="loop", keep=KeepState.CHECKPOINT)
    reply = []
    while engine.has_unfinished():
        reply += [t.token_id for out in engine.step() for t in out.new_tokens]
    step = history + reply + prompt_of(30, seed=4)
    engine.add_request("b", step, GREEDY, prefix_scope="loop")
    held = len(history) + len(reply) - 1  # the end: all it saw and generated but its last token
    assert engine.load().waiting_prefill_tokens == len(step) - held
    engine.add_request("c", step, GREEDY, prefix_scope="another loop")  # another scope holds nothing
    assert engine.load().waiting_prefill_tokens == len(step) - held + len(step)
