"""The cache key is (conversation_id, cache_salt): the same id under another salt is another
conversation. It is a miss, shares no state and no ledger, and cannot be read back with the
wrong salt."""

from __future__ import annotations

import pytest

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    check_turn_against_reference,
    greedy,
    head_of,
    new_cache,
    new_engine,
    reference_prompt,
    snapshot,
    user,
)
from workers.checkpoint import Arch
from workers.errors import ConversationNotFoundError


def test_other_salt_is_a_miss_and_shares_nothing(models, reference_engines):
    ref = reference_engines[Arch.BAMBA]
    eng = new_engine(models[Arch.BAMBA])
    cc = new_cache(eng)
    for turn, text in enumerate(["my secret is 1234", "repeat it"], start=1):
        check_turn_against_reference(cc, ref, "c1", "alice", user(text), greedy(6), f"a{turn}")
    alice_head = head_of(cc, "c1", "alice")
    alice_state, stats = snapshot(eng, alice_head.holder), cc.stats()
    alice_ledger = cc.describe(ConversationRef("c1", "alice"))

    # Bob sends the same conversation id with his salt: a fresh conversation.
    bob = check_turn_against_reference(cc, ref, "c1", "bob", user("what was it?"), greedy(6), "b1")
    assert bob.num_cached_tokens == 0
    assert bob.request.prompt_token_ids == reference_prompt(ref, [], user("what was it?")), "no foreign history"
    after = cc.stats()
    assert after.get("hits", 0) == stats.get("hits", 0) and after["tokens_reused"] == stats["tokens_reused"]
    bob_ledger = cc.describe(ConversationRef("c1", "bob"))
    assert bob_ledger["turn"] == 1 and bob_ledger["messages"][0] == user("what was it?")[0]
    bob_head = head_of(cc, "c1", "bob")
    assert not set(eng.caches.kv.table(bob_head.holder)) & set(eng.caches.kv.table(alice_head.holder))
    assert not set(eng.caches.states.slots[bob_head.holder]) & set(eng.caches.states.slots[alice_head.holder])

    with pytest.raises(ConversationNotFoundError):
        cc.describe(ConversationRef("c1", "mallory"))
    with pytest.raises(ConversationNotFoundError):
        cc.describe(ConversationRef("c1", "alic"))  # a prefix of the salt is another salt
    # Bob's turns never touch Alice's head or ledger; Alice continues with a hit.
    bob2 = check_turn_against_reference(cc, ref, "c1", "bob", user("again"), greedy(6), "b2")
    assert bob2.num_cached_tokens == bob_head.state_len, "bob's own head is reused"
    snapshot(eng, alice_head.holder).assert_equal(alice_state)
    assert cc.describe(ConversationRef("c1", "alice")) == alice_ledger
    cc.delete(ConversationRef("c1", "bob"))
    with pytest.raises(ConversationNotFoundError):
        cc.describe(ConversationRef("c1", "bob"))
    assert cc.describe(ConversationRef("c1", "alice")) == alice_ledger
    alice = check_turn_against_reference(cc, ref, "c1", "alice", user("thanks"), greedy(6), "a3")
    assert alice.num_cached_tokens == alice_head.state_len
