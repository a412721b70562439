"""Two-phase turn commit: a finished turn is prepared (base head intact), then committed (no
copy) or abandoned (base head byte-identical, pools as before); each resolves exactly once;
an unresolved one expires; a prepared turn is the same state an at-once commit publishes.
"""

from __future__ import annotations

import time

import pytest

from proto.contract import ConversationRef, tokens_digest
from tests.conversation.helpers import (
    check_turn_against_reference,
    drive,
    greedy,
    head_of,
    new_cache,
    new_engine,
    run_turn,
    snapshot,
    user,
)
from workers.checkpoint import Arch
from workers.conversation.records import CommitMode, TurnCommit
from workers.errors import ConversationBusyError, RequestIdInUseError, TurnResolvedError
from workers.request import FinishReason

C = ConversationRef("c", "s")  # the conversation most tests here use


def pools(engine):
    return engine.caches.kv.usage(), engine.caches.states.usage()


def prepared_turn(cc, cid: str, text: str, rid: str, max_tokens: int = 9) -> TurnCommit:
    cc.begin_turn(ConversationRef(cid, "s"), user(text), greedy(max_tokens), rid, commit=CommitMode.PREPARE)
    outputs = []
    while cc.engine.has_unfinished():
        outputs += [o for o in cc.engine.step() if o.request_id == rid]
    final = outputs[-1]
    assert final.finished and isinstance(final.turn_commit, TurnCommit)
    assert cc.prepared(rid) == final.turn_commit
    return final.turn_commit


@pytest.fixture
def bamba_cc(models):
    return new_cache(new_engine(models[Arch.BAMBA]))


def test_abandon_leaves_the_base_head_byte_identical_and_pools_as_before(bamba_cc):
    cc = bamba_cc
    run_turn(cc, "c", "s", user("first"), greedy(11), "t1")
    base = head_of(cc, "c", "s")
    before, counts, ledger = snapshot(cc.engine, base.holder), pools(cc.engine), cc.describe(C)

    record = prepared_turn(cc, "c", "second", "t2")
    assert head_of(cc, "c", "s") is base and base.pins == 1, "the base head stays, pinned"
    with pytest.raises(ConversationBusyError):
        cc.begin_turn(C, user("meanwhile"), greedy(), "t2b")  # busy until resolved
    cc.abandon(record)

    snapshot(cc.engine, base.holder).assert_equal(before)
    assert pools(cc.engine) == counts
    assert cc.describe(C) == ledger and base.pins == 0
    with pytest.raises(TurnResolvedError, match="abandoned"):
        cc.commit(record)
    with pytest.raises(TurnResolvedError, match="abandoned"):
        cc.abandon(record)
    assert cc.stats()["discarded"] == 1


def test_prepared_record_describes_the_turn_and_commit_is_refused_twice(models, reference_engines):
    arch = Arch.NEMOTRON_H
    cc = new_cache(new_engine(models[arch]))
    first = check_turn_against_reference(cc, reference_engines[arch], "c", "s", user("hello"), greedy(8), "t1")
    committed_before = cc.describe(C)
    record = prepared_turn(cc, "c", "again", "t2", max_tokens=7)
    assert record.conversation == C
    assert (record.base_turn, record.base_version, record.start) == (1, 1, committed_before["committed_tokens"])
    assert record.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert record.messages[0] == user("again")[0] and record.messages[-1]["role"] == "assistant"
    assert record.committed_tokens == record.start + len(record.token_ids) == record.state_len + 1
    assert cc.describe(C) == committed_before, "nothing is committed before the verdict"

    info = cc.commit(record)
    after = cc.describe(C)
    assert after["token_ids"] == committed_before["token_ids"] + list(record.token_ids)
    assert record.tokens_digest == tokens_digest(after["token_ids"]) == info.tokens_digest
    assert (info.turn, info.version, after["version"]) == (2, 2, 2)
    assert head_of(cc, "c", "s").state_len == record.state_len == info.state_len
    with pytest.raises(TurnResolvedError, match="committed"):
        cc.commit(record)
    with pytest.raises(TurnResolvedError, match="committed"):
        cc.abandon(record)
    assert first.num_cached_tokens == 0


def test_two_phase_turn_equals_an_at_once_turn(models):
    """Same conversation on two engines, one committing at once, one two-phase: same heads."""
    arch = Arch.GRANITEMOEHYBRID
    at_once, two_phase = new_cache(new_engine(models[arch])), new_cache(new_engine(models[arch]))
    for turn, text in enumerate(["a", "bb", "ccc"], 1):
        run_turn(at_once, "c", "s", user(text), greedy(6 + turn), f"t{turn}")
        record = prepared_turn(two_phase, "c", text, f"t{turn}", max_tokens=6 + turn)
        two_phase.commit(record)
        assert at_once.describe(C) == two_phase.describe(C)
        a, b = head_of(at_once, "c", "s"), head_of(two_phase, "c", "s")
        sa, sb = snapshot(at_once.engine, a.holder), snapshot(two_phase.engine, b.holder)
        for name in ("kv", "conv", "ssm"):
            for x, y in zip(getattr(sa, name), getattr(sb, name)):
                assert x.equal(y), name


def test_a_prepared_turn_nobody_resolves_expires(bamba_cc):
    cc = bamba_cc
    run_turn(cc, "c", "s", user("first"), greedy(5), "t1")
    counts = pools(cc.engine)
    record = prepared_turn(cc, "c", "second", "t2")
    timeout = cc.engine.config.cache.prepared_turn_timeout_s
    assert cc.engine.caches.heads.expire(time.monotonic()) == []  # not yet
    assert len(cc.engine.caches.heads.expire(time.monotonic() + timeout + 1)) == 1
    assert pools(cc.engine) == counts and cc.prepared("t2") is None
    assert cc.stats()["prepared_expired"] == 1
    with pytest.raises(TurnResolvedError, match="expired"):
        cc.commit(record)
    run_turn(cc, "c", "s", user("second, again"), greedy(5), "t2-retry")  # not busy any more
    assert cc.describe(C)["turn"] == 2


def test_an_aborted_two_phase_turn_prepares_nothing(bamba_cc):
    cc = bamba_cc
    run_turn(cc, "c", "s", user("first"), greedy(5), "t1")
    base = head_of(cc, "c", "s")
    before, counts = snapshot(cc.engine, base.holder), pools(cc.engine)
    cc.begin_turn(C, user("second"), greedy(30), "t2", commit=CommitMode.PREPARE)
    cc.engine.step()
    cc.engine.abort("t2")
    finals = drive(cc.engine)
    assert "t2" not in finals or finals["t2"].finish_reason is FinishReason.ABORT
    assert cc.prepared("t2") is None and pools(cc.engine) == counts
    snapshot(cc.engine, base.holder).assert_equal(before)


async def test_the_worker_flow_over_the_async_engine(models):
    """What a worker replica does: stream a PREPARE turn, read the record from the final
    output, commit on the engine thread; rebuild a head elsewhere with a streamed materialize."""
    from workers.async_engine import AsyncEngine

    cc = new_cache(new_engine(models[Arch.BAMBA]))
    aengine = AsyncEngine(cc.engine)
    other = new_cache(new_engine(models[Arch.BAMBA]))
    aother = AsyncEngine(other.engine)
    try:
        for turn in (1, 2):
            start = lambda e, t=turn: cc.begin_turn(ConversationRef(# noqa: E731
                "c", "s"), user(f"turn {t}"), greedy(6), f"t{t}", commit=CommitMode.PREPARE
            )
            outputs = [o async for o in aengine.stream(f"t{turn}", start)]
            record = outputs[-1].turn_commit
            assert record.base_version == turn - 1 and await aengine.call(lambda e: cc.prepared(record.request_id))
            info = await aengine.call(lambda e, r=record: cc.commit(r))
            assert info.version == turn
        ledger = await aengine.call(lambda e: cc.describe(C))
        await aother.call(lambda e: other.adopt_ledger(C, version=ledger["version"], turns=ledger["ledger"]))
        outs = [o async for o in aother.stream("rebuild", lambda e: other.materialize_head(C, "rebuild"))]
        assert outs[-1].finished and outs[-1].error is None
        assert [o async for o in aother.stream("again", lambda e: other.materialize_head(C, "again"))] == []
        assert await aother.call(lambda e: head_of(other, "c", "s").state_len) == head_of(cc, "c", "s").state_len
    finally:
        aengine.shutdown()
        aother.shutdown()


def test_pool_pressure_never_takes_the_base_of_a_prepared_turn(models):
    """4 slots: the base head holds 2, the prepared turn 2. Another conversation's turn cannot
    fit while the verdict is pending; it must not get them by evicting the base head."""
    cc = new_cache(new_engine(models[Arch.BAMBA], num_state_slots=4))
    run_turn(cc, "a", "s", user("first"), greedy(5), "a1")
    base = head_of(cc, "a", "s")
    before = snapshot(cc.engine, base.holder)
    record = prepared_turn(cc, "a", "second", "a2")
    cc.begin_turn(ConversationRef("b", "s"), user("other"), greedy(5), "b1")
    result = drive(cc.engine)["b1"]
    assert result.error, "it cannot fit while the prepared turn holds its slots"
    assert head_of(cc, "a", "s") is base, "the base of a prepared turn was evicted"
    snapshot(cc.engine, base.holder).assert_equal(before)
    cc.abandon(record)
    run_turn(cc, "b", "s", user("other"), greedy(5), "b1-retry")


async def test_the_idle_async_loop_expires_a_prepared_turn(models):
    """Nothing else happens on the engine: the loop must still wake up for the deadline."""
    import asyncio

    from workers.async_engine import AsyncEngine

    cc = new_cache(new_engine(models[Arch.BAMBA], prepared_turn_timeout_s=0.2))
    aengine = AsyncEngine(cc.engine)
    try:
        start = lambda e: cc.begin_turn(C, user("hi"), greedy(4), "t1", commit=CommitMode.PREPARE)  # noqa: E731
        record = [o async for o in aengine.stream("t1", start)][-1].turn_commit
        deadline = time.monotonic() + 30
        while await aengine.call(lambda e: cc.prepared("t1")) is not None:  # no event to await: a deadline
            assert time.monotonic() < deadline, "the prepared turn never expired"
            await asyncio.sleep(0.05)
        with pytest.raises(TurnResolvedError, match="expired"):
            await aengine.call(lambda e: cc.commit(record))
        assert await aengine.call(lambda e: cc.stats()["prepared_expired"]) == 1
    finally:
        aengine.shutdown()


def test_a_request_id_awaiting_its_verdict_cannot_be_reused(bamba_cc):
    """The id of a prepared turn names it until it is resolved: another turn (of another
    conversation) under that id used to replace it, so the first could never be committed."""
    cc = bamba_cc
    record = prepared_turn(cc, "a", "first", "t")
    with pytest.raises(RequestIdInUseError):
        cc.begin_turn(ConversationRef("b", "s"), user("other"), greedy(5), "t", commit=CommitMode.PREPARE)
    with pytest.raises(RequestIdInUseError):
        cc.engine.add_request("t", [1, 2, 3], greedy(2))
    assert cc.describe(ConversationRef("a", "s"))["turn"] == 0 and cc.stats()["ledgers"] == 1 and cc.ledger(record.conversation)
    info = cc.commit(record)
    assert info.turn == 1 and cc.describe(ConversationRef("a", "s"))["token_ids"] == list(record.token_ids)
    run_turn(cc, "b", "s", user("other"), greedy(5), "t")  # free again once resolved


def test_a_failed_regenerate_commit_leaves_the_old_head_and_the_ledger_intact(bamba_cc, monkeypatch):
    """Committing a regenerated turn replaces the head of that turn only once the new state has
    moved: if the move fails, the old head is still there, byte-identical, and so is the ledger."""
    cc = bamba_cc
    run_turn(cc, "c", "s", user("one"), greedy(6), "t1")
    run_turn(cc, "c", "s", user("two"), greedy(6), "t2")
    old = head_of(cc, "c", "s", 2)
    before, ledger = snapshot(cc.engine, old.holder), cc.describe(C)

    cc.regenerate(C, greedy(5), "regen", commit=CommitMode.PREPARE)
    record = [o for o in drive_outputs(cc) if o.request_id == "regen"][-1].turn_commit

    def failing_transfer(src, dst):
        raise RuntimeError("slot transfer failed")

    monkeypatch.setattr(cc.engine.caches.states, "transfer", failing_transfer)
    with pytest.raises(RuntimeError, match="slot transfer failed"):
        cc.commit(record)
    monkeypatch.undo()
    assert head_of(cc, "c", "s", 2) is old, "the old head of the regenerated turn is still held"
    snapshot(cc.engine, old.holder).assert_equal(before)
    assert cc.describe(C) == ledger and cc.prepared("regen") == record
    cc.engine.check_integrity()

    info = cc.commit(record)  # the prepared turn is still whole: the retry succeeds
    assert info.turn == 2 and head_of(cc, "c", "s", 2) is not old
    assert old.holder not in cc.engine.caches.kv.tables and old.holder not in cc.engine.caches.states.slots
    assert cc.describe(C)["token_ids"] != ledger["token_ids"]


def drive_outputs(cc) -> list:
    outputs = []
    while cc.engine.has_unfinished():
        outputs += cc.engine.step()
    return outputs
