"""Batching and cache pressure change nothing about a request's output:
alone == inside a batch of 16; tiny block pool (preemption, recompute) == big pool;
few state slots (requests wait, slots are reused) == plenty of slots.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import (
    GREEDY,
    LogitRecorder,
    assert_all_free,
    assert_logits_close,
    kv_bytes_for_blocks,
    new_engine,
    prompt_of,
    run_engine,
)
from tests.families import ARCHS
from workers.checkpoint import Arch
from workers.request import FinishReason
from workers.sampling import SamplingParams

LENGTHS = [1, 3, 8, 15, 16, 17, 20, 31, 32, 33, 40, 47, 5, 12, 25, 60]
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module", params=list(Arch), ids=lambda a: a.value)
def alone(request, tiny):
    """Each of the 16 prompts generated alone (greedy and seeded), with the logits sampled from."""
    ckpt = tiny[request.param]
    engine = new_engine(ckpt.path)
    recorder = LogitRecorder(engine)
    tokens = {}
    for i, n in enumerate(LENGTHS):
        for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            rid = f"{kind}{i}"
            tokens[rid] = run_engine(engine, {rid: prompt_of(n, seed=i)}, params).tokens[rid]
    return ckpt, tokens, recorder


def _batch(ckpt, **engine_kw):
    engine = new_engine(ckpt.path, **engine_kw)
    recorder = LogitRecorder(engine)
    prompts, params = {}, {}
    for i, n in enumerate(LENGTHS):
        for kind, p in (("greedy", GREEDY), ("seeded", SEEDED)):
            prompts[f"{kind}{i}"] = prompt_of(n, seed=i)
            params[f"{kind}{i}"] = p
    return run_engine(engine, prompts, params), recorder


@pytest.mark.parametrize("budget", [2048, 64], ids=["all-prefill-at-once", "mixed-prefill-decode"])
def test_alone_equals_batched(alone, budget):
    ckpt, tokens, ref = alone
    run, recorder = _batch(ckpt, max_num_batched_tokens=budget)
    for rid, expected in tokens.items():
        assert run.tokens[rid] == expected, rid
        assert_logits_close(recorder.stacked(rid), ref.stacked(rid))
    if budget == 64:
        assert run.steps > max(len(t) for t in tokens.values()) + 1  # prefills really spread over steps


@ARCHS
def test_max_num_seqs_limits_the_batch(tiny, arch):
    engine = new_engine(tiny[arch].path, max_num_seqs=2)
    widest = []
    inner = engine.runner.execute

    def execute(step):
        widest.append(len({c.request.request_id for c in step.chunks}))
        return inner(step)

    engine.runner.execute = execute
    prompts = {f"r{i}": prompt_of(5 + 7 * i, seed=i) for i in range(5)}
    run = run_engine(engine, prompts)
    assert max(widest) == 2
    ref = new_engine(tiny[arch].path)
    ref_run = run_engine(ref, prompts)
    assert run.tokens == ref_run.tokens


def _tiny_pool(ckpt, usable_blocks=16, block_size=4, **kw):
    return new_engine(
        ckpt.path, block_size=block_size, kv_cache_bytes=kv_bytes_for_blocks(ckpt.path, usable_blocks, block_size), **kw
    )


@ARCHS
@pytest.mark.parametrize("params", [GREEDY.__class__(max_tokens=12, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_tiny_pool_preempts_and_outputs_are_unchanged(tiny, arch, params):
    ckpt = tiny[arch]
    prompts = {f"r{i}": prompt_of(n, seed=i) for i, n in enumerate([10, 14, 7, 20, 12, 9])}
    big = new_engine(ckpt.path, block_size=4)
    big_logits = LogitRecorder(big)
    ref = run_engine(big, prompts, params)
    assert not ref.preempted

    small = _tiny_pool(ckpt)  # 16 blocks of 4 = 64 tokens; each request alone needs <= 8 blocks
    assert small.kv_layout.usable_blocks == 16
    small_logits = LogitRecorder(small)
    run = run_engine(small, prompts, params)
    assert run.preempted, "the tiny pool should have forced a preemption"
    assert any(r.num_preemptions > 0 for r in run.requests.values())
    assert run.tokens == ref.tokens
    for rid in prompts:
        assert run.requests[rid].finish_reason is FinishReason.LENGTH
        assert_logits_close(small_logits.stacked(rid), big_logits.stacked(rid))
    assert_all_free(small)


@ARCHS
def test_tiny_pool_with_chunked_prefill(tiny, arch):
    """Preemption while other requests are mid-prefill (budget 6), with only 3 state slots
    (re-admitted requests reuse dirty slots), still changes nothing."""
    ckpt = tiny[arch]
    prompts = {f"r{i}": prompt_of(n, seed=10 + i) for i, n in enumerate([18, 9, 25, 4])}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = run_engine(new_engine(ckpt.path, block_size=4), prompts, params)
    run = run_engine(_tiny_pool(ckpt, usable_blocks=12, max_num_batched_tokens=6, num_state_slots=3), prompts, params)
    assert run.preempted
    assert run.tokens == ref.tokens


@ARCHS
def test_request_larger_than_the_pool_does_not_livelock(tiny, arch):
    """prompt + max_tokens needs more blocks than exist: the engine must end the request
    (error or length) instead of preempting and re-admitting it forever, and keep serving."""
    ckpt = tiny[arch]
    engine = _tiny_pool(ckpt, usable_blocks=6)  # 24 tokens
    run = run_engine(engine, {"big": prompt_of(10, seed=1)},
                     SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), max_steps=200)
    assert run.requests["big"].is_finished
    assert_all_free(engine)
    ok = run_engine(engine, {"small": prompt_of(5, seed=2)}, GREEDY)
    assert len(ok.tokens["small"]) == GREEDY.max_tokens


@ARCHS
def test_reused_state_slots_start_clean(tiny, arch):
    """With 2 state slots every new request reuses a slot another request left state in;
    its outputs must be those of a fresh engine (the Mamba conv/SSM state is reset)."""
    ckpt = tiny[arch]
    engine = new_engine(ckpt.path, num_state_slots=2)
    recorder = LogitRecorder(engine)
    a, b = prompt_of(30, seed=1), prompt_of(40, seed=2)
    first = run_engine(engine, {"a0": a}).tokens["a0"]
    run_engine(engine, {"b0": b})
    again = run_engine(engine, {"a1": a}).tokens["a1"]
    run_engine(engine, {"a2": a})
    assert again == first
    assert_logits_close(recorder.stacked("a1"), recorder.stacked("a0"))
    assert_logits_close(recorder.stacked("a2"), recorder.stacked("a0"))


@ARCHS
def test_few_state_slots_queue_requests(tiny, arch):
    """3 slots, 7 concurrent requests: admission waits for slots, outputs are unchanged."""
    ckpt = tiny[arch]
    prompts = {f"r{i}": prompt_of(4 + 5 * i, seed=i) for i in range(7)}
    ref = run_engine(new_engine(ckpt.path), prompts)
    engine = new_engine(ckpt.path, num_state_slots=3)
    running = []
    inner = engine.runner.execute

    def execute(step):
        running.append(len(engine.scheduler.running))
        return inner(step)

    engine.runner.execute = execute
    run = run_engine(engine, prompts)
    assert max(running) <= 3
    assert run.tokens == ref.tokens
