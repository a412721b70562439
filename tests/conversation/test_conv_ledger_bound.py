"""The worker's ledgers are a cache of the service's: `drop_headless_ledgers` forgets those with
no head held and nothing in flight (the worker reads the service's ledger again when a turn
needs it); in-process use never calls it and keeps every ledger, its record."""

from __future__ import annotations

from proto.contract import ConversationRef
from tests.conversation.helpers import drive, greedy, new_cache, new_engine, run_turn, user
from workers.checkpoint import Arch


def test_headless_idle_ledgers_are_dropped_and_the_rest_kept(models):
    cc = new_cache(new_engine(models[Arch.BAMBA]))
    held, headless, kept, running = (ConversationRef(cid, "s") for cid in ("held", "headless", "kept", "running"))
    run_turn(cc, "held", "s", user("a head stays here"), greedy(5), "t1")
    ledger = cc.describe(held)["ledger"]
    for conv in (headless, kept):  # the recovery ladder's first step: a ledger, no head yet
        cc.adopt_ledger(conv, version=1, turns=ledger)
    cc.adopt_ledger(running, version=1, turns=ledger)
    cc.begin_turn(running, user("in flight"), greedy(5), "t2")  # not stepped yet
    assert cc.stats()["ledgers"] == 4 and cc.head_count() == 1

    assert cc.drop_headless_ledgers(keep=[kept]) == 1

    assert cc.ledger_state(headless) is None
    assert cc.ledger_state(held) is not None and cc.head_count(held) == 1
    assert cc.ledger_state(kept) is not None
    assert cc.ledger_state(running).busy
    assert cc.stats()["ledgers"] == 3
    drive(cc.engine)  # the turn in flight commits (at once) onto its ledger, untouched
    assert cc.ledger_state(running).turn == 2 and cc.head_count(running) == 1

    # Dropped is as never seen: the service's ledger is adopted again and the turn runs.
    cc.adopt_ledger(headless, version=1, turns=ledger)
    result = run_turn(cc, "headless", "s", user("back"), greedy(5), "t3")
    assert result.error is None and cc.ledger_state(headless).turn == 2


def test_a_salt_is_part_of_what_is_kept(models):
    cc = new_cache(new_engine(models[Arch.BAMBA]))
    s1, s2 = ConversationRef("c", "s1"), ConversationRef("c", "s2")
    run_turn(cc, "c", "s1", user("hello"), greedy(5), "t1")
    cc.adopt_ledger(s2, version=1, turns=cc.describe(s1)["ledger"])
    assert cc.drop_headless_ledgers(keep=[s1]) == 1  # s1's head keeps it anyway; s2 goes
    assert cc.ledger_state(s2) is None and cc.ledger_state(s1) is not None


def test_in_process_ledgers_outlive_their_heads(models):
    """Without the call, a ledger whose heads were all evicted stays: it is the record."""
    cc = new_cache(new_engine(models[Arch.BAMBA]))
    run_turn(cc, "c", "s", user("hello"), greedy(5), "t1")
    ledger = cc.describe(ConversationRef("c", "s"))["ledger"]
    cc.adopt_ledger(ConversationRef("d", "s"), version=1, turns=ledger)
    run_turn(cc, "d", "s", user("again"), greedy(5), "t2")  # d's own turn: d now holds a head
    cc.rewind(ConversationRef("d", "s"), 0)  # d holds no head now, and an empty ledger
    assert cc.ledger_state(ConversationRef("d", "s")) is not None and cc.head_count(ConversationRef("d", "s")) == 0
    assert cc.stats()["ledgers"] == 2
