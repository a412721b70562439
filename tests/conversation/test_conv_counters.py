"""The cache's counters: hits and misses at the start of a continuing turn, tokens reused and
published turns when a turn commits, copy-on-write of the head's tail block (only when the
committed length is not block-aligned), Mamba state copies, discarded turns, head bytes."""

from __future__ import annotations

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    BLOCK,
    check_turn_against_reference,
    conversation,
    greedy,
    head_of,
    new_cache,
    new_engine,
    reference_prompt,
    user,
)
from workers.checkpoint import Arch

COUNTERS = (
    "hits", "misses", "tokens_reused", "published", "discarded", "cow_block_copies", "state_copies", "evictions",
)  # fmt: skip


def counters(cc) -> dict[str, int]:
    stats = cc.stats()
    return {k: stats.get(k, 0) for k in COUNTERS}


def max_tokens_for_tail(engine, cc, messages, tail: int) -> int:
    history = cc.describe(ConversationRef("c1", "s"))["messages"] if conversation(cc, "c1", "s") else []
    n = len(reference_prompt(engine, history, messages))
    return next(m for m in range(4, 4 + BLOCK) if (n + m - 1) % BLOCK == tail)


def test_counters_move_as_expected(models, reference_engines):
    arch = Arch.NEMOTRON_H
    ref = reference_engines[arch]
    eng = new_engine(models[arch])
    cc = new_cache(eng)
    expected = dict.fromkeys(COUNTERS, 0)
    assert counters(cc) == expected and cc.stats()["heads"] == 0 and cc.stats()["head_bytes"] == 0

    def turn(text: str, tail: int, rid: str):
        messages = user(text)
        return check_turn_against_reference(
            cc, ref, "c1", "s", messages, greedy(max_tokens_for_tail(eng, cc, messages, tail)), rid
        )

    turn("first", 5, "t1")  # a new conversation: neither hit nor miss
    expected["published"] = 1
    assert counters(cc) == expected
    head1 = head_of(cc, "c1", "s")
    block_bytes, slot_bytes = eng.kv_layout.block_bytes, eng.state_layout.slot_bytes
    assert cc.stats()["head_bytes"] == -(-head1.state_len // BLOCK) * block_bytes + 2 * slot_bytes

    turn("second", 0, "t2")  # continues an unaligned head: its tail block is copied
    expected.update(hits=1, published=2, tokens_reused=head1.state_len, cow_block_copies=1, state_copies=1)
    assert counters(cc) == expected
    head2 = head_of(cc, "c1", "s")

    turn("third", 3, "t3")  # continues an aligned head: nothing to copy but the Mamba state
    expected.update(hits=2, published=3, tokens_reused=head1.state_len + head2.state_len, state_copies=2)
    assert counters(cc) == expected

    cc.begin_turn(ConversationRef("c1", "s"), user("aborted"), greedy(20), "t4")
    eng.step()
    eng.abort("t4")
    expected.update(hits=3, discarded=1, cow_block_copies=2, state_copies=3)  # head 3 is unaligned
    assert counters(cc) == expected

    cc.rewind(ConversationRef("c1", "s"), 2)  # head 2 was released when turn 3 committed (retain_turns=1)
    miss = turn("after rewind", 1, "t3b")
    assert miss.num_cached_tokens == 0
    expected.update(misses=1, published=4)
    assert counters(cc) == expected
    assert cc.stats()["heads"] == 1 and cc.stats()["evictions"] == 0


def test_fresh_stats_report_every_counter(models):
    """Counters are reported as zeros before they first move (an exporter reads them by name)."""
    stats = new_cache(new_engine(models[Arch.NEMOTRON_H])).stats()
    missing = [k for k in COUNTERS if k not in stats]
    assert not missing, f"stats() lacks {missing} until they first move"
