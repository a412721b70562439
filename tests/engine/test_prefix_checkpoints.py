"""Prefix checkpoints: a request attaches the longest held state whose tokens are a prefix of
its prompt (a finished request's end, a message boundary it was marked at) and runs only the
rest; its tokens and logits equal a run without any reuse. Another scope never attaches it;
deterministic requests never do; a small budget evicts, and never returns a wrong state."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY, LogitRecorder, assert_logits_close, kv_bytes_for_blocks, new_engine, prompt_of
from workers.cache.prefix_wait import MIN_SHARED_TOKENS
from workers.checkpoint import Arch
from workers.engine import LLMEngine, RequestOutput
from workers.request import CheckpointMark, KeepState, ReuseSource
from workers.sampling import SamplingParams

CHAIN = KeepState.CHECKPOINT


class Driver:
    """One engine, requests run to completion one call at a time (several at once: `run_all`)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.recorder = LogitRecorder(engine)
        self._n = 0

    def run(self, prompt, **kw) -> tuple[list[int], RequestOutput]:
        return self.run_all([prompt], **kw)[0]

    def run_all(self, prompts, scope="tenant", keep=CHAIN, marks=(), params=GREEDY) -> list[tuple[list[int], RequestOutput]]:
        ids = []
        for prompt in prompts:
            self._n += 1
            rid = f"r{self._n}"
            self.engine.add_request(rid, prompt, params, prefix_scope=scope, keep=keep, marks=tuple(marks),
                                    final_label=99)
            ids.append(rid)
        tokens = {rid: [] for rid in ids}
        final: dict[str, RequestOutput] = {}
        for _ in range(10_000):
            if not self.engine.has_unfinished():
                break
            for out in self.engine.step():
                assert out.error is None, out.error
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    final[out.request_id] = out
        return [(tokens[rid], final[rid]) for rid in ids]


@pytest.fixture(params=list(Arch), ids=lambda a: a.value)
def pair(request, tiny):
    """(an engine keeping prefix checkpoints, one without any reuse) on the same checkpoint."""
    path = tiny[request.param].path
    return Driver(new_engine(path)), Driver(new_engine(path, prefix_cache_bytes=0))


def test_full_history_requests_attach_the_previous_requests_end(pair):
    ours, plain = pair
    history = prompt_of(40, seed=1)
    for turn in range(4):
        tokens, out = ours.run(history)
        expected, ref = plain.run(history)
        assert tokens == expected
        assert_logits_close(ours.recorder.stacked(out.request_id), plain.recorder.stacked(ref.request_id))
        assert ref.num_cached_tokens == 0 and ref.checkpoints == ()
        if turn:
            # everything the previous request saw and generated but its last token
            assert out.num_cached_tokens == previous - 1 and out.reused_from is ReuseSource.PREFIX
        else:
            assert out.num_cached_tokens == 0 and out.reused_from is ReuseSource.NONE
        assert out.checkpoints == ((99, len(history) + len(tokens) - 1),)
        history = history + tokens
        previous = len(history)
        history += prompt_of(9 + turn, seed=10 + turn)  # the next user message


@pytest.mark.parametrize("budget", [2048, 16, 37], ids=["one-chunk", "chunks-of-16", "chunk-ends-at-the-mark"])
def test_a_marked_system_prompt_is_shared_within_its_scope_only(tiny, budget):
    path = tiny[Arch.BAMBA].path
    ours = Driver(new_engine(path, max_num_batched_tokens=budget))
    plain = Driver(new_engine(path, prefix_cache_bytes=0))
    system = prompt_of(37, seed=3)
    mark = CheckpointMark(len(system), label=1, source=ReuseSource.SYSTEM)
    first = system + prompt_of(20, seed=4)
    tokens, out = ours.run(first, keep=KeepState.FREE, marks=[mark])
    assert out.checkpoints == ((1, 37),) and out.num_cached_tokens == 0
    assert tokens == plain.run(first)[0]

    second = system + prompt_of(25, seed=5)
    tokens, out = ours.run(second, keep=KeepState.FREE, marks=[mark])
    assert out.num_cached_tokens == 37 and out.reused_from is ReuseSource.SYSTEM
    assert out.checkpoints == ()  # already held: not made twice
    expected, ref = plain.run(second)
    assert tokens == expected
    assert_logits_close(ours.recorder.stacked(out.request_id), plain.recorder.stacked(ref.request_id))

    assert ours.run(second, scope="another tenant", keep=KeepState.FREE)[1].num_cached_tokens == 0
    deterministic = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, deterministic=True)
    assert ours.run(second, keep=KeepState.FREE, params=deterministic)[1].num_cached_tokens == 0


def test_the_longest_held_prefix_wins_and_a_token_is_always_left_to_run(tiny):
    path = tiny[Arch.BAMBA].path
    ours, plain = Driver(new_engine(path)), Driver(new_engine(path, prefix_cache_bytes=0))
    prompt = prompt_of(50, seed=6)
    marks = [CheckpointMark(n, label=n) for n in (10, 20, 30)]  # one chunk cut in four segments
    assert ours.run(prompt, keep=KeepState.FREE, marks=marks)[1].checkpoints == ((10, 10), (20, 20), (30, 30))
    for variant, cached in ((prompt[:35], 30), (prompt[:30], 20), (prompt[:25] + [7] * 10, 20), ([7] + prompt[1:40], 0)):
        tokens, out = ours.run(variant, keep=KeepState.FREE)
        expected, ref = plain.run(variant)
        assert out.num_cached_tokens == cached  # 30 tokens of 30 would leave nothing to run; ids, exactly
        assert tokens == expected
        assert_logits_close(ours.recorder.stacked(out.request_id), plain.recorder.stacked(ref.request_id))


@pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
def test_marks_at_aligned_positions_of_a_turn_that_publishes(tiny, arch):
    """keep=PREPARE snapshots the aligned state too: a mark at an aligned position is the same
    cut with two slots; a mark inside a later chunk cuts that chunk."""
    path = tiny[arch].path
    ours = Driver(new_engine(path, max_num_batched_tokens=24))
    plain = Driver(new_engine(path, prefix_cache_bytes=0))
    prompt = prompt_of(45, seed=9)
    marks = [CheckpointMark(16, label=1), CheckpointMark(29, label=2)]
    (tokens, out), = ours.run_all([prompt], keep=KeepState.PREPARE, marks=marks)
    heads = ours.engine.caches.heads
    prepared = heads.prepared_of(out.request_id)
    assert out.checkpoints == ((1, 16), (2, 29)) and prepared.aligned_len == 48  # 45 + 7 tokens: last at 48
    heads.release(prepared)
    assert tokens == plain.run(prompt)[0]
    for n in (16, 29):
        variant = prompt[:n] + prompt_of(7, seed=n)
        tokens, out = ours.run(variant, keep=KeepState.FREE)
        expected, ref = plain.run(variant)
        assert out.num_cached_tokens == n and tokens == expected
        assert_logits_close(ours.recorder.stacked(out.request_id), plain.recorder.stacked(ref.request_id))


def test_marks_a_request_never_snapshot_or_never_reached_leave_nothing(tiny):
    """One-token chunks run on the decode path, which snapshots no mark: none is made. An
    aborted request's open marks are freed (the check after the test finds a leaked slot)."""
    path = tiny[Arch.BAMBA].path
    ours = Driver(new_engine(path, max_num_batched_tokens=1))
    prompt = prompt_of(20, seed=11)
    tokens, out = ours.run(prompt, keep=KeepState.FREE, marks=[CheckpointMark(12, label=1)])
    assert out.checkpoints == () and not ours.engine.caches.heads.checkpoints
    assert tokens == Driver(new_engine(path, prefix_cache_bytes=0)).run(prompt)[0]
    engine = ours.engine
    engine.add_request("aborted", prompt, GREEDY, prefix_scope="tenant", marks=(CheckpointMark(15, label=1),))
    for _ in range(3):
        engine.step()
    assert engine.caches.heads.marks_of("aborted")
    engine.abort("aborted")
    assert engine.caches.heads.marking == {} and not engine.caches.heads.checkpoints


def test_marks_under_preemption_leave_nothing_behind(tiny):
    """A pool so small that requests are preempted mid-prefill: their unfinished marks are
    dropped (the integrity check after the test finds any leak), outputs are unchanged."""
    path = tiny[Arch.BAMBA].path
    ours = Driver(new_engine(path, kv_cache_bytes=kv_bytes_for_blocks(path, 12, 16), max_num_batched_tokens=32))
    plain = Driver(new_engine(path, prefix_cache_bytes=0))
    system = prompt_of(30, seed=7)
    prompts = [system + prompt_of(40 + i, seed=20 + i) for i in range(6)]
    marks = [CheckpointMark(30, label=1, source=ReuseSource.SYSTEM)]
    requests = []
    inner = ours.engine.add_request
    ours.engine.add_request = lambda *a, **kw: requests.append(inner(*a, **kw)) or requests[-1]
    results = ours.run_all(prompts, keep=KeepState.FREE, marks=marks)
    assert sum(r.num_preemptions for r in requests) > 0  # the pool did force preemptions
    assert any(out.checkpoints for _, out in results) and ours.engine.caches.heads.marking == {}
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == plain.run(prompt)[0]


def test_a_small_budget_evicts_spent_chains_first_and_never_returns_a_wrong_state(tiny):
    path = tiny[Arch.BAMBA].path
    probe = new_engine(path, prefix_cache_bytes=0)
    slot, block = probe.state_layout.slot_bytes, probe.kv_layout.block_bytes
    ours = Driver(new_engine(path, prefix_cache_bytes=4 * slot + 24 * block))
    plain = Driver(new_engine(path, prefix_cache_bytes=0))
    system = prompt_of(33, seed=8)
    mark = CheckpointMark(33, label=1, source=ReuseSource.SYSTEM)
    histories = [system + prompt_of(10 + i, seed=30 + i) for i in range(4)]
    for round in range(3):  # every chain takes a turn
        for i, history in enumerate(histories):
            tokens, out = ours.run(history, marks=[mark])
            assert tokens == plain.run(history)[0]
            if round or i:
                assert out.num_cached_tokens >= 33  # the system prompt at least, whatever was evicted
            histories[i] = history + tokens + prompt_of(5, seed=40 + i)
    heads = ours.engine.caches.heads
    assert heads.counters["checkpoint_evictions"] > 0
    kept = [c for c in heads.checkpoints.values() if c.state_len == 33]
    assert kept and kept[0].hits >= 3  # the shared system prompt outlived the spent chain links
    assert heads.bytes_used(kept[0].holder.kind) <= heads.checkpoint_budget_bytes


def test_evicted_checkpoints_are_withdrawn_by_the_names_their_outputs_gave(tiny):
    # The worker withdraws a checkpoint's announce from the prefix index by the name its output gave.
    path = tiny[Arch.BAMBA].path
    probe = new_engine(path, prefix_cache_bytes=0)
    slot, block = probe.state_layout.slot_bytes, probe.kv_layout.block_bytes
    ours = Driver(new_engine(path, prefix_cache_bytes=2 * slot + 8 * block))
    made = []
    for i in range(6):  # unrelated stateless requests: each end is a checkpoint, the budget keeps about two
        _, out = ours.run(prompt_of(20 + i, seed=60 + i))
        assert len(out.checkpoint_keys) == len(out.checkpoints) == 1
        made += out.checkpoint_keys
    held = {c.prefix for c in ours.engine.caches.heads.checkpoints.values()}
    withdrawn = ours.engine.withdrawn_prefixes()
    assert withdrawn and held and len(withdrawn) == len(set(withdrawn))
    assert set(withdrawn) | held == set(made) and not set(withdrawn) & held
    assert ours.engine.withdrawn_prefixes() == []  # each reported once


def test_a_burst_sharing_a_system_prompt_attaches_the_first_ones_mark_at_admission(tiny):
    """Four requests arrive together; the token budget admits one per step: each later one is
    admitted after the first one's prefill passed its mark, and attaches it then."""
    path = tiny[Arch.BAMBA].path
    ours = Driver(new_engine(path, max_num_batched_tokens=48))
    plain = Driver(new_engine(path, prefix_cache_bytes=0))
    system = prompt_of(40, seed=12)
    prompts = [system + prompt_of(20, seed=50 + i) for i in range(4)]
    mark = CheckpointMark(40, label=1, source=ReuseSource.SYSTEM)
    results = ours.run_all(prompts, keep=KeepState.FREE, marks=[mark])
    assert [out.num_cached_tokens for _, out in results] == [0, 40, 40, 40]
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == plain.run(prompt)[0]


@pytest.mark.parametrize("budget", [2048, 48])
def test_requests_arriving_together_wait_for_the_first_ones_checkpoint(tiny, budget):
    """The budget fits all four in one step: without waiting, each would compute the shared
    40 tokens. The later ones wait while the first one's prefill has not passed its mark, then
    attach it; the tokens are those of a run without any reuse. A shorter shared prefix (under
    MIN_SHARED_TOKENS) is not waited for, and another scope never waits on it."""
    path = tiny[Arch.BAMBA].path
    ours = Driver(new_engine(path, max_num_batched_tokens=budget))
    plain = Driver(new_engine(path, prefix_cache_bytes=0))
    system = prompt_of(40, seed=13)
    prompts = [system + prompt_of(20, seed=60 + i) for i in range(4)]
    mark = CheckpointMark(40, label=1, source=ReuseSource.SYSTEM)
    results = ours.run_all(prompts, keep=KeepState.FREE, marks=[mark])
    assert [out.num_cached_tokens for _, out in results] == [0, 40, 40, 40]
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == plain.run(prompt)[0]

    short = [prompt_of(MIN_SHARED_TOKENS - 2, seed=14) + prompt_of(20, seed=70 + i) for i in range(2)]
    short_mark = CheckpointMark(MIN_SHARED_TOKENS - 2, label=1, source=ReuseSource.SYSTEM)
    assert [out.num_cached_tokens for _, out in ours.run_all(short, keep=KeepState.FREE, marks=[short_mark])] == (
        [0, 0] if budget >= 100 else [0, MIN_SHARED_TOKENS - 2])


def test_a_waiting_request_never_waits_on_another_scope(tiny):
    path = tiny[Arch.BAMBA].path
    engine = new_engine(path)
    system = prompt_of(40, seed=15)
    mark = (CheckpointMark(40, label=1, source=ReuseSource.SYSTEM),)
    first = engine.add_request("a", system + prompt_of(20, seed=1), GREEDY, prefix_scope="one", marks=mark)
    other = engine.add_request("b", system + prompt_of(20, seed=2), GREEDY, prefix_scope="two", marks=mark)
    same = engine.add_request("c", system + prompt_of(20, seed=3), GREEDY, prefix_scope="one", marks=mark)
    engine.step()
    assert first.num_computed_tokens > 0 and other.num_computed_tokens > 0  # admitted together
    assert same.num_computed_tokens == 0  # waits for a's checkpoint
    while engine.has_unfinished():
        engine.step()
    assert same.num_cached_tokens == 40


def _wait_for_tools(driver: Driver, histories: list[list[int]]) -> list[list[int]]:
    """Each history run as an agent loop's step whose reply was a tool call (the tiny model's
    replies are not: its end is marked so); the loops' histories with their replies."""
    heads = driver.engine.caches.heads
    loops = []
    for history in histories:
        tokens, _ = driver.run(history)
        (end,) = [c for c in heads.checkpoints.values() if c.state_len == len(history) + len(tokens) - 1]
        end.awaiting_tool = True
        loops.append(history + tokens)
    return loops


def test_a_mark_never_evicts_an_agent_loops_end_within_the_tool_pause_share(tiny):
    """The budget holds three states: two loops' ends, each waiting for its tools' results, and
    one more; the ends (72% of its bytes, a third of its slots) are within a tool-pause share of
    3/4. Another loop's request brings two marks (its system prompt, its last message): one
    fits, the other must not take a waiting end (a mark may help some later request; the end is
    what this loop's next step attaches). Both loops' next steps reuse all they left."""
    path = tiny[Arch.BAMBA].path
    probe = new_engine(path, prefix_cache_bytes=0)
    slot, block = probe.state_layout.slot_bytes, probe.kv_layout.block_bytes
    # the ends take 2 slots and 10 blocks
    ours = Driver(new_engine(path, prefix_cache_bytes=3 * slot + 13 * block, tool_pause_share=0.75))
    plain = Driver(new_engine(path, prefix_cache_bytes=0))
    heads = ours.engine.caches.heads
    loops = _wait_for_tools(ours, [prompt_of(60 + i, seed=80 + i) for i in range(2)])
    other = prompt_of(40, seed=90) + prompt_of(30, seed=91)
    marks = [CheckpointMark(40, label=1, source=ReuseSource.SYSTEM), CheckpointMark(60, label=2)]
    tokens, out = ours.run(other, marks=marks, keep=KeepState.FREE)
    assert tokens == plain.run(other)[0] and len(out.checkpoints) == 1  # the mark that fitted
    for history in loops:  # each loop's next step: its history, the reply, a tool result
        prompt = history + prompt_of(12, seed=95)
        tokens, out = ours.run(prompt)
        assert out.num_cached_tokens == len(history) - 1, "the loop's end was evicted while it waited"
        assert tokens == plain.run(prompt)[0]
    assert heads.counters["tool_pause_evictions"] == 0


def test_a_mark_evicts_the_oldest_agent_loops_end_past_the_tool_pause_share(tiny):
    """Three loops' ends, each waiting for its tools' results, fill the budget (under salts
    nobody may send again, they would keep it full for tool_pause_s). With the default share
    (half) only the newest is safe from marks: a tenant's request marking its system prompt
    evicts the oldest end, least recently used first, and the prompt is kept for the tenant's
    next request. The two newest loops' next steps reuse all they left; the oldest recomputes."""
    path = tiny[Arch.BAMBA].path
    probe = new_engine(path, prefix_cache_bytes=0)
    slot, block = probe.state_layout.slot_bytes, probe.kv_layout.block_bytes
    ours = Driver(new_engine(path, prefix_cache_bytes=3 * (slot + 5 * block)))  # each end takes 1 and 5
    plain = Driver(new_engine(path, prefix_cache_bytes=0))
    heads = ours.engine.caches.heads
    loops = _wait_for_tools(ours, [prompt_of(60 + i, seed=80 + i) for i in range(3)])
    ends = {c.state_len: c for c in heads.checkpoints.values()}
    assert sorted(ends) == [len(history) - 1 for history in loops]
    system = prompt_of(40, seed=90)
    mark = CheckpointMark(40, label=1, source=ReuseSource.SYSTEM)
    prompt = system + prompt_of(30, seed=91)
    tokens, out = ours.run(prompt, marks=[mark], keep=KeepState.FREE)
    assert tokens == plain.run(prompt)[0]
    assert len(out.checkpoints) == 1, "no room was made for the tenant's system prompt"
    assert [heads.holds(ends[len(history) - 1]) for history in loops] == [False, True, True]
    assert heads.counters["tool_pause_evictions"] == 1
    prompt = system + prompt_of(30, seed=92)
    tokens, out = ours.run(prompt, keep=KeepState.FREE)
    assert out.num_cached_tokens == 40 and tokens == plain.run(prompt)[0]
    for i, history in enumerate(loops):  # each loop's next step: its history, the reply, a tool result
        prompt = history + prompt_of(12, seed=95)
        tokens, out = ours.run(prompt, keep=KeepState.FREE)
        assert out.num_cached_tokens == (0 if i == 0 else len(history) - 1), f"loop {i}"
        assert tokens == plain.run(prompt)[0]


def test_a_request_never_waits_for_a_mark_that_will_not_be_kept(tiny):
    """Two agent loops' ends, waiting for their tools' results, fill the checkpoint budget and
    are all within the tool-pause share: the first request's mark gets no room and will make no
    checkpoint. A request sharing its prefix must not wait for it (it would wait through the
    whole prefill, then compute the prefix anyway): both run at once, with the tokens of a run
    without reuse."""
    path = tiny[Arch.BAMBA].path
    probe = new_engine(path, prefix_cache_bytes=0)
    slot, block = probe.state_layout.slot_bytes, probe.kv_layout.block_bytes
    ours = Driver(new_engine(path, prefix_cache_bytes=2 * (slot + 5 * block), tool_pause_share=1.0))
    plain = Driver(new_engine(path, prefix_cache_bytes=0))
    _wait_for_tools(ours, [prompt_of(60 + i, seed=80 + i) for i in range(2)])
    engine = ours.engine
    system = prompt_of(40, seed=16)
    mark = (CheckpointMark(40, label=1, source=ReuseSource.SYSTEM),)
    prompts = [system + prompt_of(20, seed=1), system + prompt_of(20, seed=2)]
    requests = [engine.add_request(f"x{i}", p, GREEDY, prefix_scope="tenant", marks=mark) for i, p in enumerate(prompts)]
    engine.step()
    assert [r.num_computed_tokens > 0 for r in requests] == [True, True], "waited for a mark with no room"
    while engine.has_unfinished():
        engine.step()
    for request, prompt in zip(requests, prompts):
        assert list(request.output_token_ids) == plain.run(prompt)[0]
