"""POST /v1/conversations/{id}/items with the official SDK: items appended without a turn are
committed like one (all or none, a new head version), listed, and in the next turn's prompt,
of which only they and the new message are computed."""

from __future__ import annotations

import openai
import pytest

from tests.serve.helpers import chat_turn, conversation, stateless_reference, user

pytestmark = pytest.mark.timeout(300)


async def test_items_join_the_next_turns_prompt_and_only_they_are_computed(stack, conv_id):
    client = stack.client()
    salt = {"cache_salt": conv_id}
    first = await chat_turn(client, stack.model, [user("the first question")], conversation_id=conv_id,
                            cache_salt=conv_id)
    async with stack.http() as http:
        before = (await conversation(http, conv_id, conv_id))["head"]
        added = await client.conversations.items.create(conv_id, extra_query=salt, items=[
            {"type": "message", "role": "user", "content": "a note added without a reply"},
            {"role": "assistant", "content": [{"type": "input_text", "text": "and an answer written by hand"}]}])
        after = (await conversation(http, conv_id, conv_id))["head"]
    assert [(i.role, i.content[0].text) for i in added.data] == [
        ("user", "a note added without a reply"), ("assistant", "and an answer written by hand")]
    assert after["version"] == before["version"] + 1 and after["turn"] == before["turn"] + 1
    assert after["committed_tokens"] > before["committed_tokens"]
    listed = await client.conversations.items.list(conv_id, order="asc", extra_query=salt)
    assert [i.id for i in listed.data[-2:]] == [i.id for i in added.data]
    assert [i.role for i in listed.data] == ["user", "assistant", "user", "assistant"]

    reply = await chat_turn(client, stack.model, [user("the next question")], conversation_id=conv_id,
                            cache_salt=conv_id)
    history = [user("the first question"), {"role": "assistant", "content": first.text},
               user("a note added without a reply"), {"role": "assistant", "content": "and an answer written by hand"},
               user("the next question")]
    reference = await stateless_reference(client, stack.model, history)
    assert reply.turn == after["turn"] + 1
    assert reply.tokens == reference.tokens and reply.prompt_tokens == reference.prompt_tokens
    assert reply.prompt_tokens > after["committed_tokens"]  # the items are in the prompt
    # The owner's state of the head before the items served: all of it but its last token (sampled,
    # never fed), so only the items and the new message were computed.
    assert reply.cached_tokens == before["committed_tokens"] - 1


async def test_bad_or_unknown_items_change_nothing(stack, conv_id):
    client = stack.client()
    salt = {"cache_salt": conv_id}
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.create(conv_id, items=[user("hello")], extra_query=salt)
    await chat_turn(client, stack.model, [user("hello")], conversation_id=conv_id, cache_salt=conv_id)
    async with stack.http() as http:
        before = await conversation(http, conv_id, conv_id)
        for items in ([user("fine"), {"role": "tool", "content": "no such role"}], [],
                      [user(str(i)) for i in range(21)]):
            refused = await http.post(f"/v1/conversations/{conv_id}/items", params=salt, json={"items": items})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["type"] == "invalid_request_error"
        assert await conversation(http, conv_id, conv_id) == before  # all or none: none
