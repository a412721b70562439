"""The ledger's token ids are authoritative: the next turn extends exactly what the model saw,
even when the reply holds a special token the text of the reply does not show.

With ignore_eos a reply can hold <|end_of_turn|> in its middle (this granite seed emits it
after five tokens). Its decoded content drops the special token, so the rendered history no
longer starts with the committed text; the next turn must still extend the committed ids
and reuse the head, not fall back to re-tokenizing a history the model never saw.
"""

from __future__ import annotations

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    check_turn_against_reference,
    greedy,
    head_of,
    new_cache,
    new_engine,
    run_turn,
    user,
)
from workers.checkpoint import EOS_TOKEN_ID, Arch


def test_reply_with_inner_end_of_turn_keeps_its_token_ids(models, reference_engines):
    arch = Arch.GRANITEMOEHYBRID
    cc = new_cache(new_engine(models[arch]))
    first = run_turn(cc, "c1", "s", user("abc def"), greedy(12, ignore_eos=True), "t1")
    assert EOS_TOKEN_ID in first.tokens[:-1], "the reply was meant to hold an inner <|end_of_turn|>"
    committed = cc.describe(ConversationRef("c1", "s"))["token_ids"]
    head = head_of(cc, "c1", "s")

    second = check_turn_against_reference(cc, reference_engines[arch], "c1", "s", user("next"), greedy(6), "t2")
    assert second.request.prompt_token_ids[: len(committed)] == committed, "history re-tokenized"
    assert second.num_cached_tokens == head.state_len and cc.stats().get("misses", 0) == 0
