"""What a response id names stays what it names: a failed forked turn leaves no fork, a request
planned on a response that was deleted (and whose turn number another turn took) is a 404, and
an Idempotency-Key retry is answered with the same response instead of running a second turn."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import openai
import pytest
import redis

from cache_service.client import CacheClient
from proto.contract import ConversationRef, tokens_digest
from tests.serve.helpers import MAX_TOKENS, conversation

pytestmark = pytest.mark.timeout(300)


def _salt() -> str:
    return f"integrity-{uuid.uuid4().hex[:12]}"


async def respond(client: openai.AsyncOpenAI, model: str, text: str, salt: str, **kw):
    return await client.responses.create(model=model, input=text, temperature=0, max_output_tokens=MAX_TOKENS,
                                         extra_body={"cache_salt": salt}, **kw)


def _heads(stack) -> set[bytes]:
    """The head key of every conversation in Redis (a fork is a conversation of its own)."""
    with redis.Redis.from_url(stack.redis.url) as r:
        return set(r.scan_iter(match="hs:v1:conv:*:head"))


async def test_a_forked_turn_that_fails_leaves_no_fork(stack):
    client, salt = stack.client(), _salt()
    first = await respond(client, stack.model, "a story about a cat", salt)
    await respond(client, stack.model, "go on", salt, previous_response_id=first.id)
    before = _heads(stack)
    # An older response: the turn runs on a fork, and the worker refuses it (too long).
    with pytest.raises(openai.BadRequestError) as refused:
        await respond(client, stack.model, "x" * 5000, salt, previous_response_id=first.id)
    assert refused.value.code == "context_length_exceeded"
    assert _heads(stack) == before
    branch = await respond(client, stack.model, "make it a dog", salt, previous_response_id=first.id)
    assert branch.conversation.id != first.conversation.id and _heads(stack) - before  # a fork that commits stays


BUSY = "AcquireLease:FAILED_PRECONDITION"  # the service's count of lease requests refused as busy


async def _replace_while_planned(stack, conv: ConversationRef, send: Callable[[], Awaitable], keep: int):
    """Under a lease the test takes first, so that the request `send` makes is planned and then
    waits for it (its refused AcquireLease calls show in the service's counters): rewind the
    conversation to turn `keep` (what DELETE does) and commit its later turns again, the same
    messages and tokens under new publish ids: other responses with the same turn numbers.
    Returns the request's task."""
    async with CacheClient(stack.service.target) as cache:
        ledger = await cache.read_ledger(conv)
        lease = await cache.acquire_lease(conv, 30_000)
        try:
            refused = (await cache.stats()).rpc_errors.get(BUSY, 0)
            request = asyncio.create_task(send())
            while (await cache.stats()).rpc_errors.get(BUSY, 0) == refused:  # planned, waiting
                assert not request.done(), request
                await asyncio.sleep(0.02)
            head = await cache.rewind_conversation(conv, lease_token=lease, expected_version=ledger.head.version,
                                                   turn=keep)
            committed = [t for turn in ledger.turns[:keep] for t in turn.token_ids]
            for index in range(keep, len(ledger.turns)):
                turn = ledger.turns[index]
                committed += turn.token_ids
                head = await cache.publish_turn(
                    conv, lease_token=lease, expected_version=head.version, messages=turn.messages,
                    token_ids=turn.token_ids, committed_tokens=len(committed), tokens_sha256=tokens_digest(committed),
                    release_lease=index == len(ledger.turns) - 1, publish_id=f"resp-{uuid.uuid4().hex}",
                    result=turn.result)
        except BaseException:
            await cache.discard(conv, lease)
            raise
    return request


@pytest.mark.parametrize("latest", [True, False], ids=["continued", "forked"])
async def test_a_response_deleted_and_replaced_while_planned_on_is_a_404(stack, latest):
    client, salt = stack.client(), _salt()
    first = await respond(client, stack.model, "a story about a cat", salt)
    second = await respond(client, stack.model, "go on", salt, previous_response_id=first.id)
    if not latest:
        await respond(client, stack.model, "and then?", salt, previous_response_id=second.id)
    conv = ConversationRef(first.conversation.id, salt)
    before = _heads(stack)
    request = await _replace_while_planned(
        stack, conv, lambda: respond(client, stack.model, "what next?", salt, previous_response_id=second.id), keep=1)
    with pytest.raises(openai.NotFoundError):
        await request
    assert _heads(stack) == before  # the fork that copied the other turn is gone
    async with stack.http() as http:
        state = await conversation(http, conv.id, salt)
    assert state["turn"] == (2 if latest else 3)  # nothing appended to the other responses


async def test_an_idempotency_key_retry_gets_the_same_response(stack):
    client, salt = stack.client(), _salt()

    async def once(key: str, text: str, **kw):
        return await respond(client, stack.model, text, salt, extra_headers={"Idempotency-Key": key}, **kw)

    first = await once("k1", "a story about a cat")
    again = await once("k1", "a story about a cat")
    assert (again.id, again.output_text, again.conversation.id) == (first.id, first.output_text,
                                                                     first.conversation.id)
    second = await once("k2", "go on", previous_response_id=first.id)
    assert (await once("k2", "go on", previous_response_id=first.id)).id == second.id
    heads = _heads(stack)
    branch = await once("k3", "make it a dog", previous_response_id=first.id)  # on a fork
    retried = await once("k3", "make it a dog", previous_response_id=first.id)
    assert (retried.id, retried.output_text) == (branch.id, branch.output_text)
    assert len(_heads(stack) - heads) == 1  # one fork, not one per try
    async with stack.http() as http:
        assert (await conversation(http, first.conversation.id, salt))["turn"] == 2
        assert (await conversation(http, branch.conversation.id, salt))["turn"] == 2
    with pytest.raises(openai.UnprocessableEntityError) as reused:
        await once("k2", "something else", previous_response_id=first.id)
    assert reused.value.code == "idempotency_key_reused"


async def test_a_retry_of_a_forked_turn_is_answered_once_its_source_is_gone(stack):
    """The fork's id is derived from the key, so the retry finds its turn without the source (a
    source deleted, or expired by retention while the fork ran, as in the chaos run)."""
    client, salt = stack.client(), _salt()
    key = {"Idempotency-Key": f"fork-{uuid.uuid4().hex}"}
    first = await respond(client, stack.model, "a story about a cat", salt)
    await respond(client, stack.model, "go on", salt, previous_response_id=first.id)
    branch = await respond(client, stack.model, "make it a dog", salt, previous_response_id=first.id,
                           extra_headers=key)
    async with stack.http() as http:
        gone = await http.delete(f"/v1/conversations/{first.conversation.id}", params={"cache_salt": salt})
        assert gone.status_code == 200, gone.text
    retried = await respond(client, stack.model, "make it a dog", salt, previous_response_id=first.id,
                            extra_headers=key)
    assert (retried.id, retried.output_text, retried.conversation.id) == (branch.id, branch.output_text,
                                                                         branch.conversation.id)
    async with stack.http() as http:
        assert (await conversation(http, branch.conversation.id, salt))["turn"] == 2  # not run again
    with pytest.raises(openai.NotFoundError):  # without the key, the source is simply gone
        await respond(client, stack.model, "make it a dog", salt, previous_response_id=first.id)
    with pytest.raises(openai.NotFoundError):  # another key names no fork
        await respond(client, stack.model, "make it a dog", salt, previous_response_id=first.id,
                      extra_headers={"Idempotency-Key": f"other-{uuid.uuid4().hex}"})
