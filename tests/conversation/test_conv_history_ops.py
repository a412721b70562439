"""Regenerate, rewind, fork and delete: each gives what recomputing the resulting history from
scratch gives (the stateless reference), reuses a retained head when there is one, and keeps
reference counts exact (forked heads share KV blocks by reference, never Mamba slots).
"""

from __future__ import annotations

import pytest
import torch

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    BLOCK,
    assert_same_output,
    check_turn_against_reference,
    drive,
    greedy,
    head_of,
    new_cache,
    new_engine,
    reference_prompt,
    run_stateless,
    snapshot,
    user,
)
from workers.state_names import Holder
from workers.checkpoint import Arch
from workers.errors import ConversationNotFoundError, InvalidRequestError

C1 = ConversationRef("c1", "s")  # the conversation most tests here use


def holders_of(kv, block: int) -> set:
    return {holder for holder, table in kv.tables.items() if block in table}


TEXTS = ["hello", "tell me more", "and then?", "why so?"]


@pytest.fixture
def three_turns(models, reference_engines, request):
    """(cache, reference engine): conversation c1 with three committed turns, retaining two."""
    arch = getattr(request, "param", Arch.BAMBA)
    ref = reference_engines[arch]
    cc = new_cache(new_engine(models[arch]), retain_turns=2)
    for turn, text in enumerate(TEXTS[:3], start=1):
        check_turn_against_reference(cc, ref, "c1", "s", user(text), greedy(5 + turn), f"t{turn}")
    assert cc.describe(C1)["retained_turns"] == [2, 3]
    return cc, ref


def history_until(cc, turn: int) -> list[dict]:
    """Messages of turns 1..turn, from the ledger."""
    ledger = cc.describe(C1)
    per_turn = len(ledger["messages"]) // ledger["turn"]  # one user message + one reply per turn
    return ledger["messages"][: per_turn * turn]


@pytest.mark.parametrize("three_turns", list(Arch), indirect=True, ids=lambda a: a.value)
def test_regenerate_reuses_previous_head(three_turns):
    cc, ref = three_turns
    eng = cc.engine
    base = head_of(cc, "c1", "s", 2)
    base_state, old_last = snapshot(eng, base.holder), head_of(cc, "c1", "s", 3)
    history, last_user = history_until(cc, 2), cc.describe(C1)["messages"][4]
    hits = cc.stats()["hits"]

    request = cc.regenerate(C1, greedy(4), "regen")
    regen = drive(eng)["regen"]
    expected = run_stateless(ref, {"x": reference_prompt(ref, history, [last_user])}, greedy(4))["x"]
    assert_same_output(regen, expected, "regenerate")
    assert regen.num_cached_tokens == base.state_len and cc.stats()["hits"] == hits + 1
    assert request.token_ids[: base.state_len + 1] == cc.describe(C1)["token_ids"][: base.state_len + 1]

    ledger = cc.describe(C1)
    assert ledger["turn"] == 3 and ledger["messages"][:5] == history + [last_user]
    assert ledger["messages"][5]["content"] == eng.tokenizer.decode(regen.tokens)
    assert ledger["token_ids"] == request.token_ids
    snapshot(eng, base.holder).assert_equal(base_state)
    assert head_of(cc, "c1", "s", 3) is not old_last and old_last.holder not in eng.caches.kv.tables
    # The conversation goes on from the regenerated turn.
    check_turn_against_reference(cc, ref, "c1", "s", user(TEXTS[3]), greedy(6), "t4")


def test_regenerate_without_retained_base_is_a_miss(models, reference_engines):
    ref = reference_engines[Arch.NEMOTRON_H]
    cc = new_cache(new_engine(models[Arch.NEMOTRON_H]), retain_turns=1)
    for turn, text in enumerate(TEXTS[:2], start=1):
        check_turn_against_reference(cc, ref, "c1", "s", user(text), greedy(6), f"t{turn}")
    history, last_user = history_until(cc, 1), cc.describe(C1)["messages"][2]
    misses = cc.stats().get("misses", 0)
    cc.regenerate(C1, greedy(9), "regen")
    regen = drive(cc.engine)["regen"]
    assert regen.num_cached_tokens == 0 and cc.stats()["misses"] == misses + 1
    expected = run_stateless(ref, {"x": reference_prompt(ref, history, [last_user])}, greedy(9))["x"]
    assert_same_output(regen, expected, "regenerate after a miss")
    check_turn_against_reference(cc, ref, "c1", "s", user("next"), greedy(6), "t3")


def test_rewind_to_retained_and_evicted_turns(three_turns):
    cc, ref = three_turns
    full = cc.describe(C1)
    head2 = head_of(cc, "c1", "s", 2)

    cc.rewind(C1, 2)
    ledger = cc.describe(C1)
    assert ledger["turn"] == 2 and ledger["retained_turns"] == [2]
    assert ledger["token_ids"] == full["token_ids"][: head2.state_len + 1]
    assert ledger["messages"] == full["messages"][:4]
    hit = check_turn_against_reference(cc, ref, "c1", "s", user("something else"), greedy(7), "r3")
    assert hit.num_cached_tokens == head2.state_len

    cc.rewind(C1, 1)  # turn 1's head was never retained: recompute from the ledger's ids
    turn1_ids = cc.describe(C1)["token_ids"]
    assert turn1_ids == full["token_ids"][: len(turn1_ids)] and cc.describe(C1)["retained_turns"] == []
    misses = cc.stats().get("misses", 0)
    miss = check_turn_against_reference(cc, ref, "c1", "s", user("other"), greedy(7), "r2")
    assert miss.num_cached_tokens == 0 and cc.stats()["misses"] == misses + 1
    assert miss.request.prompt_token_ids[: len(turn1_ids)] == turn1_ids and cc.describe(C1)["turn"] == 2

    with pytest.raises(ConversationNotFoundError):
        cc.rewind(C1, 3)
    cc.rewind(C1, 0)
    assert cc.describe(C1)["token_ids"] == [] and cc.head_count() == 0
    fresh = check_turn_against_reference(cc, ref, "c1", "s", user("start over"), greedy(5), "r1")
    assert fresh.num_cached_tokens == 0


def test_fork_shares_blocks_and_both_branches_are_exact(three_turns):
    cc, ref = three_turns
    eng = cc.engine
    kv, states = eng.caches.kv, eng.caches.states
    source = head_of(cc, "c1", "s", 2)
    source_state = snapshot(eng, source.holder)

    last = head_of(cc, "c1", "s", 3)
    counts_before = [kv.pool.ref_counts[b] for b in kv.table(source.holder)]
    cc.fork(C1, 2, "c2")
    fork = head_of(cc, "c2", "s", 2)
    assert fork is not None and fork.state_len == source.state_len and fork.aligned_len == source.aligned_len
    blocks = kv.table(fork.holder)
    assert blocks == kv.table(source.holder), "the fork shares the source's blocks by reference"
    assert [kv.pool.ref_counts[b] for b in blocks] == [n + 1 for n in counts_before]
    full = fork.state_len // BLOCK
    # c1's turn-3 head continued turn 2: it shares turn 2's full blocks but copied its tail.
    assert all(holders_of(kv, b) == {source.holder, fork.holder, last.holder} for b in blocks[:full])
    assert all(holders_of(kv, b) == {source.holder, fork.holder} for b in blocks[full:])
    assert not set(states.slots[fork.holder]) & set(states.slots[source.holder]), "Mamba states are copied"
    fork_state = snapshot(eng, fork.holder)
    for a, b in zip(fork_state.conv + fork_state.ssm, source_state.conv + source_state.ssm):
        assert torch.equal(a, b)
    fork_ledger = cc.describe(ConversationRef("c2", "s"))
    assert fork_ledger["turn"] == 2 and fork_ledger["messages"] == history_until(cc, 2)
    assert fork_ledger["token_ids"] == cc.describe(C1)["token_ids"][: fork.state_len + 1]

    # Both branches continue in the same batch; each turn shares its head's full blocks.
    c1_history, c2_history = cc.describe(C1)["messages"], fork_ledger["messages"]
    cc.begin_turn(C1, user("branch one"), greedy(6), "b1")
    cc.begin_turn(ConversationRef("c2", "s"), user("branch two"), greedy(6), "b2")
    first = {out.request_id: out for out in eng.step()}
    assert set(first) == {"b1", "b2"} and first["b2"].num_cached_tokens == fork.state_len
    turns = {Holder.request("b1"), Holder.request("b2")}
    for b in blocks[:full]:
        assert holders_of(kv, b) == {source.holder, fork.holder, last.holder} | turns
        assert kv.pool.ref_counts[b] == 5
    assert all(holders_of(kv, b) == {source.holder, fork.holder} for b in blocks[full:]), "tails are copied"
    snapshot(eng, source.holder).assert_equal(source_state)  # c1 turn 4 dropped it when it published
    results = drive(eng)
    for rid, out in first.items():
        results[rid].tokens[:0] = out.new_token_ids
        results[rid].logprobs[:0] = [t.logprob for t in out.new_tokens]
    expected = run_stateless(
        ref,
        {
            "x1": reference_prompt(ref, c1_history, user("branch one")),
            "x2": reference_prompt(ref, c2_history, user("branch two")),
        },
        greedy(6),
    )
    assert_same_output(results["b1"], expected["x1"], "c1 after the fork")
    assert_same_output(results["b2"], expected["x2"], "c2, the fork")
    snapshot(eng, fork.holder).assert_equal(fork_state)  # c2's turn wrote only its own copies

    with pytest.raises(InvalidRequestError):
        cc.fork(C1, 1, "c2")  # exists already
    # Deleting the original leaves the fork intact.
    cc.delete(C1)
    assert head_of(cc, "c1", "s") is None
    check_turn_against_reference(cc, ref, "c2", "s", user("still here?"), greedy(6), "b3")


def test_fork_of_unretained_turn_recomputes(three_turns):
    cc, ref = three_turns
    cc.fork(C1, 1, "c3")
    assert head_of(cc, "c3", "s") is None and cc.describe(ConversationRef("c3", "s"))["turn"] == 1
    misses = cc.stats().get("misses", 0)
    r = check_turn_against_reference(cc, ref, "c3", "s", user("from turn one"), greedy(6), "f1")
    assert r.num_cached_tokens == 0 and cc.stats()["misses"] == misses + 1


def test_delete_frees_everything(three_turns):
    cc, ref = three_turns
    cc.fork(C1, 3, "c2")
    cc.delete(C1)
    cc.delete(ConversationRef("c2", "s"))
    assert cc.head_count() == 0 and cc.stats()["ledgers"] == 0
    usage = cc.engine.caches.kv.usage()
    assert usage.free == usage.total, usage
    with pytest.raises(ConversationNotFoundError):
        cc.delete(C1)
    again = check_turn_against_reference(cc, ref, "c1", "s", user("hello"), greedy(6), "new")
    assert again.num_cached_tokens == 0 and cc.describe(C1)["turn"] == 1
