"""Retention through the real app: what a turn stores expires (30 days by default), an expired
conversation is a 404 like a deleted one, and a full store is a 503 `storage_full` while reads go on.

The TTL itself running out is tested on the cache service with a short TTL
(tests/cache_service/test_retention.py); here the app's session service keeps its 30-day default,
so a conversation's expiry is brought forward by shortening its keys' TTL in Redis.
"""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest
import redis
import redis.asyncio as aioredis

from cache_service.keys import ConversationKeys
from proto.contract import ConversationRef
from tests.serve.helpers import MAX_TOKENS, chat_turn, conversation, user

pytestmark = pytest.mark.timeout(300)

THIRTY_DAYS_MS = 30 * 86400 * 1000


def _keys(redis_client: redis.Redis, conv: ConversationRef) -> dict[str, int]:
    """kind (head, ledger, ...) -> PTTL of each key the conversation has in Redis."""
    pattern = f"hs:v1:conv:{{{ConversationKeys.of(conv).conv_hash}}}:*"
    return {key.decode().rsplit(":", 1)[1]: redis_client.pttl(key) for key in redis_client.scan_iter(match=pattern)}


async def _respond(client: openai.AsyncOpenAI, model: str, salt: str, text: str, **kw):
    return await client.responses.create(model=model, input=text, max_output_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"cache_salt": salt}, **kw)


async def test_a_stored_response_expires_and_is_then_a_404_like_a_deleted_one(stack):
    client, salt = stack.client(), f"retain-{uuid.uuid4().hex[:12]}"
    first = await _respond(client, stack.model, salt, "remember the number 7")
    conv = ConversationRef(first.conversation.id, salt=salt)
    with redis.Redis.from_url(stack.redis.url) as r:
        ttls = _keys(r, conv)
        assert {"head", "ledger", "marks", "fence"} <= set(ttls), ttls
        for kind in ("head", "ledger", "marks"):
            assert THIRTY_DAYS_MS - 120_000 < ttls[kind] <= THIRTY_DAYS_MS, (kind, ttls)
        assert all(ttl > 0 for ttl in ttls.values()), ttls  # nothing stored for ever
        for kind in ttls:  # its 30 days are over
            r.pexpire(f"hs:v1:conv:{{{ConversationKeys.of(conv).conv_hash}}}:{kind}", 1)
        await asyncio.sleep(0.01)
        assert _keys(r, conv) == {}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id, extra_query={"cache_salt": salt})
    with pytest.raises(openai.NotFoundError):
        await _respond(client, stack.model, salt, "and then?", previous_response_id=first.id)
    async with stack.http() as http:
        gone = await http.get(f"/v1/conversations/{conv.id}", params={"cache_salt": salt})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "conversation_not_found"
    # Its id starts a new conversation, as after a DELETE: the workers' copies of it are not used.
    again = await chat_turn(client, stack.model, [user("hello again")], conversation_id=conv.id, cache_salt=salt)
    assert again.turn == 1


async def test_a_full_store_is_a_503_storage_full_and_reads_go_on(stack, conv_id):
    client, salt = stack.client(), f"full-{uuid.uuid4().hex[:12]}"
    await chat_turn(client, stack.model, [user("stored first")], conversation_id=conv_id, cache_salt=salt)
    doomed = f"{conv_id}-doomed"
    await chat_turn(client, stack.model, [user("delete me")], conversation_id=doomed, cache_salt=salt)
    body = {"model": stack.model, "messages": [user("and now?")], "max_tokens": MAX_TOKENS,
            "conversation_id": conv_id, "cache_salt": salt}
    async with stack.http() as http, aioredis.Redis.from_url(stack.redis.url) as r:
        # Over its maxmemory: the Redis refuses every write that may grow it (policy noeviction).
        await r.config_set("maxmemory", 1)
        try:
            refused = await http.post("/v1/chat/completions", json=body)
            stored = await http.get(f"/v1/conversations/{conv_id}", params={"cache_salt": salt})
            new = await http.post("/v1/responses", json={"model": stack.model, "input": "hi", "max_output_tokens": 4,
                                                         "cache_salt": salt})
            deleted = await http.delete(f"/v1/conversations/{doomed}", params={"cache_salt": salt})
        finally:
            await r.config_set("maxmemory", 0)
        for response in (refused, new):
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "storage_full" and error["type"] == "service_unavailable", error
            assert "full" in error["message"] and response.headers["retry-after"]
        assert stored.status_code == 200 and stored.json()["turn"] == 1
        # A full store can still be freed: a DELETE needs no write that grows it.
        assert deleted.status_code == 200, deleted.text
        assert (await http.get(f"/v1/conversations/{doomed}", params={"cache_salt": salt})).status_code == 404
        # Room again: the conversation goes on from where it was.
        assert (await http.post("/v1/chat/completions", json=body)).json()["turn"] == 2
        assert (await conversation(http, conv_id, salt))["turn"] == 2
