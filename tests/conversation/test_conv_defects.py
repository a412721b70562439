"""Regression tests of defects found in review: each fails on the code before its fix.

- a publish that raises must fail its own turn only: no exception out of step(), no leak,
  the other turns of the batch complete, the base head and the ledger are untouched;
- a failure while moving the state must leave the ledger as it was (no turn without a head);
- fork must never evict its own source (and then copy from a freed slot);
- the integrity check must notice blocks held by a head nobody knows;
- the state-slot pool must hold max_num_seqs publishing turns (two slots each).
"""

from __future__ import annotations

import pytest

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    assert_same_output,
    drive,
    greedy,
    head_of,
    new_cache,
    new_engine,
    reference_prompt,
    run_stateless,
    run_turn,
    snapshot,
    user,
)
from workers.state_names import Holder, HolderKind
from workers.checkpoint import Arch
from workers.errors import OutOfCacheError


def _raise_once(monkeypatch, obj, name: str):
    inner = getattr(obj, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(f"injected failure in {name}")
        return inner(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


def _two_conversations(cc):
    for cid in ("a", "b"):
        run_turn(cc, cid, "s", user(f"hello {cid}"), greedy(6), f"{cid}1")
    return {cid: (snapshot(cc.engine, head_of(cc, cid, "s").holder), cc.describe(ConversationRef(cid, "s")))
            for cid in ("a", "b")}


def test_a_raising_publish_fails_only_its_turn(models, reference_engines, monkeypatch):
    arch = Arch.BAMBA
    cc = new_cache(new_engine(models[arch]))
    before = _two_conversations(cc)
    cc.begin_turn(ConversationRef("a", "s"), user("short"), greedy(3), "a2")  # finishes first: its publish raises
    cc.begin_turn(ConversationRef("b", "s"), user("longer"), greedy(9), "b2")
    _raise_once(monkeypatch, cc.engine.tokenizer, "decode_exact")
    results = drive(cc.engine)  # must not raise: one turn's failure is not the batch's
    assert results["a2"].error and "injected failure" in results["a2"].error
    assert results["b2"].error is None
    snapshot(cc.engine, head_of(cc, "a", "s").holder).assert_equal(before["a"][0])
    assert cc.describe(ConversationRef("a", "s")) == before["a"][1], "the failed turn left no trace in the ledger"
    ref = reference_engines[arch]
    expected = run_stateless(ref, {"b2": reference_prompt(ref, before["b"][1]["messages"], user("longer"))}, greedy(9))
    assert_same_output(results["b2"], expected["b2"], "b2")
    # The conversation whose publish failed is usable again.
    run_turn(cc, "a", "s", user("short"), greedy(3), "a2-retry")
    assert cc.describe(ConversationRef("a", "s"))["turn"] == 2


def test_a_failing_state_move_leaves_the_ledger_and_the_head(models, monkeypatch):
    cc = new_cache(new_engine(models[Arch.GRANITEMOEHYBRID]))
    before = _two_conversations(cc)
    cc.begin_turn(ConversationRef("a", "s"), user("next"), greedy(4), "a2")
    _raise_once(monkeypatch, cc.engine.caches.kv, "transfer")
    results = drive(cc.engine)
    assert results["a2"].error
    assert cc.describe(ConversationRef("a", "s")) == before["a"][1], \
        "a turn was appended whose state never became a head"
    snapshot(cc.engine, head_of(cc, "a", "s").holder).assert_equal(before["a"][0])


def test_fork_never_evicts_its_own_source(models):
    # 3 slots: a publishing turn takes 2; afterwards its head holds 2 and 1 is free. A fork
    # needs 2: the only head it could evict is its source.
    cc = new_cache(new_engine(models[Arch.BAMBA], num_state_slots=3))
    run_turn(cc, "c1", "s", user("fork me"), greedy(6), "t1")
    source = head_of(cc, "c1", "s")
    before = snapshot(cc.engine, source.holder)
    try:
        cc.fork(ConversationRef("c1", "s"), 1, "c2")
        forked = True
    except OutOfCacheError:
        forked = False
    assert head_of(cc, "c1", "s") is source, "fork evicted its own source"
    snapshot(cc.engine, source.holder).assert_equal(before)
    if forked:
        copy = snapshot(cc.engine, head_of(cc, "c2", "s").holder)
        for x, y in zip(before.conv + before.ssm, copy.conv + copy.ssm):
            assert x.equal(y)
    else:
        assert head_of(cc, "c2", "s") is None


def test_integrity_check_catches_a_leaked_head_holder(models):
    engine = new_engine(models[Arch.BAMBA])
    engine.check_integrity()
    leaked = Holder(HolderKind.HEAD, 987654)  # no head of this name exists
    engine.caches.kv.append_new(leaked, 1)
    with pytest.raises(AssertionError):
        engine.check_integrity()
    engine.caches.kv.free(leaked)  # leave it clean for the per-test check
    engine.check_integrity()


def test_the_slot_pool_holds_max_num_seqs_publishing_turns(models):
    """Each turn that will publish holds two slots; the default pool must run max_num_seqs of
    them together (the config promises twice max_num_seqs plus the heads' share)."""
    seqs = 16
    engine = new_engine(
        models[Arch.BAMBA], max_num_seqs=seqs, max_num_batched_tokens=4096, head_cache_bytes=1, kv_cache_bytes=8 << 20
    )
    cc = new_cache(engine)
    for i in range(seqs):
        cc.begin_turn(ConversationRef(f"c{i}", "s"), user(f"conversation {i}"), greedy(4), f"t{i}")
    engine.step()
    assert len(engine.scheduler.running) == seqs, "publishing turns were kept waiting for state slots"
    drive(engine)


def test_integrity_check_catches_a_stale_pin_and_unadmitted_request_slots(models):
    """A pin whose request is neither live nor a prepared turn keeps its head from eviction
    forever; slots held for a request that is not admitted are never freed. Both are leaks
    the integrity check must name."""
    cc = new_cache(new_engine(models[Arch.BAMBA]))
    run_turn(cc, "c", "s", user("hello"), greedy(4), "t1")
    head = head_of(cc, "c", "s")
    finished = cc.engine.add_request("gone", [1, 2, 3], greedy(2))
    drive(cc.engine)
    head.pinned_by["gone"] = finished  # a request that ended without unpinning
    with pytest.raises(AssertionError, match="pin"):
        cc.engine.check_integrity()
    del head.pinned_by["gone"]
    cc.engine.check_integrity()
    stray = Holder.request("nobody")
    cc.engine.caches.states.allocate(stray, aligned=False)
    with pytest.raises(AssertionError, match="not admitted"):
        cc.engine.check_integrity()
    cc.engine.caches.states.free(stray)
