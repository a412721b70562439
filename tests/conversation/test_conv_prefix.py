"""Conversations and prefix checkpoints share one index: a new conversation attaches a system
prompt another one marked, a request without a conversation attaches a conversation's head,
both only under the same salt, and every output equals the stateless reference."""

from __future__ import annotations

import pytest

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    MiB,
    assert_same_output,
    check_turn_against_reference,
    drive,
    greedy,
    head_of,
    new_cache,
    new_engine,
    reference_prompt,
    run_stateless,
    run_turn,
    user,
)
from workers.checkpoint import Arch
from workers.request import KeepState, ReuseSource

SYSTEM = [{"role": "system", "content": "Answer in one short sentence, and be kind about it."}]


@pytest.fixture
def cc(models):
    return new_cache(new_engine(models[Arch.BAMBA], prefix_cache_bytes=8 * MiB))


def test_new_conversations_attach_a_system_prompt_marked_by_another_in_their_salt(cc, reference_engines):
    ref = reference_engines[Arch.BAMBA]
    tok = cc.engine.tokenizer
    system_tokens = len(tok.encode(tok.render_chat(SYSTEM, add_generation_prompt=False)))
    first = check_turn_against_reference(cc, ref, "a", "s", SYSTEM + user("hello"), greedy(6), "a1")
    assert first.num_cached_tokens == 0
    second = check_turn_against_reference(cc, ref, "b", "s", SYSTEM + user("good morning"), greedy(6), "b1")
    assert second.num_cached_tokens == system_tokens and second.request.reused_from is ReuseSource.SYSTEM
    other = check_turn_against_reference(cc, ref, "c", "other", SYSTEM + user("good morning"), greedy(6), "c1")
    assert other.num_cached_tokens == 0  # another salt: another scope
    # The conversations go on from their own heads as before.
    head = head_of(cc, "b", "s")
    again = check_turn_against_reference(cc, ref, "b", "s", user("and then?"), greedy(6), "b2")
    assert again.num_cached_tokens == head.state_len
    assert again.request.reused_from is ReuseSource.HEAD
    stats = cc.stats()  # a, b and c each marked their system prompt and its end; b hit a's mark
    assert stats["prefix_hits"] == 1 and stats["checkpoints"] == stats["checkpoints_made"] >= 2
    assert 0 < stats["checkpoint_bytes"] <= 8 * MiB


def test_a_request_without_a_conversation_attaches_a_conversations_head_in_its_salt(cc, reference_engines):
    ref = reference_engines[Arch.BAMBA]
    for turn, text in enumerate(["hello", "tell me more"], start=1):
        check_turn_against_reference(cc, ref, "a", "s", user(text), greedy(6), f"a{turn}")
    head = head_of(cc, "a", "s")
    committed = list(cc.ledger_state(ConversationRef("a", "s")).token_ids)
    prompt = committed + cc.engine.tokenizer.encode("<more/>")
    for salt, expected in (("s", head.state_len), ("another", 0)):
        rid = f"stateless-{salt}"
        cc.engine.add_request(rid, prompt, greedy(6), prefix_scope=salt, keep=KeepState.CHECKPOINT)
        result = drive(cc.engine)[rid]
        assert result.num_cached_tokens == expected
        assert_same_output(result, run_stateless(ref, {f"ref-{salt}": prompt}, greedy(6))[f"ref-{salt}"], salt)
    assert head.hits == 1 and head_of(cc, "a", "s") is head  # read, never taken


def test_a_rewound_conversation_reattaches_its_first_message(cc, reference_engines):
    """Its head is gone; the mark of its first turn still names the prefix it shares."""
    ref = reference_engines[Arch.BAMBA]
    messages = SYSTEM + user("hello")
    check_turn_against_reference(cc, ref, "a", "s", messages, greedy(6), "a1")
    check_turn_against_reference(cc, ref, "a", "s", user("more"), greedy(6), "a2")
    cc.rewind(ConversationRef("a", "s"), 0)
    again = run_turn(cc, "a", "s", messages, greedy(6), "a1-again")
    assert 0 < again.num_cached_tokens < len(reference_prompt(ref, [], messages))
    expected = run_stateless(ref, {"ref": reference_prompt(ref, [], messages)}, greedy(6))["ref"]
    assert_same_output(again, expected)
