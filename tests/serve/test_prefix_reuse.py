"""Exact reuse for ordinary OpenAI clients (no conversation_id): a client resending its whole
history gets everything the previous turn saw and generated from cache; conversations opening
with the same long system prompt compute it once; another salt gets nothing; the tokens are
those of a request computed from scratch."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cache_service.client import CacheClient
from proto.contract import message_prefix_digests
from tests.serve.conftest import APP
from tests.serve.helpers import chat_turn, metric, prefix_holders, stateless_reference, user
from tests.serve.test_recovery import kill_replica, replica_replaced

pytestmark = pytest.mark.timeout(300)

PREFIX_HOLDER_ROUTES = 'hybridserve_route_decisions_total{reason="prefix_holder"}'
PREFIX_COMPUTING_ROUTES = 'hybridserve_route_decisions_total{reason="prefix_computing"}'
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 54}  # 1,566 characters: tokens here


def _salt() -> str:
    return f"prefix-{uuid.uuid4().hex[:8]}"


async def test_full_history_turns_reuse_everything_the_previous_turn_saw(stack):
    client, salt = stack.client(), _salt()
    history: list[dict] = []
    previous = None
    async with stack.http() as http:
        hits_before = await metric(http, 'hybridserve_prefix_lookups_total{result="hit"}')
    for turn in range(1, 7):
        history.append(user(f"turn {turn}: and what about {turn * 11}?"))
        reply = await chat_turn(client, stack.model, history, conversation_id=None, cache_salt=salt)
        reference = await stateless_reference(client, stack.model, history)
        assert reply.tokens == reference.tokens and reply.text == reference.text
        assert reference.cached_tokens == 0 and reply.prompt_tokens == reference.prompt_tokens
        if previous is None:
            assert reply.cached_tokens == 0
        else:
            # the previous prompt and reply but its last token (the state covers all it computed)
            assert reply.cached_tokens >= previous.prompt_tokens + len(previous.tokens) - 1, turn
        assert reply.cached_tokens < reply.prompt_tokens
        history.append({"role": "assistant", "content": reply.text})
        previous = reply
    async with stack.http() as http:
        assert await metric(http, 'hybridserve_prefix_lookups_total{result="hit"}') >= hits_before + 5
        assert await metric(http, "hybridserve_prefix_index_names") > 0


async def test_the_next_request_finds_the_end_the_previous_one_left_before_the_index_hears_of_it(stack):
    """The announce race: an agent loop's next request follows the answer at once, and the
    worker's announce to the prefix index may land after its lookup. The ingress that forwarded
    the answer knows where its end is held: the next request goes there all the same."""
    client, salt = stack.client(), _salt()
    history = [user("first: name a colour")]
    first = await chat_turn(client, stack.model, history, conversation_id=None, cache_salt=salt)
    history.append({"role": "assistant", "content": first.text})
    names = message_prefix_digests(salt, history)
    async with CacheClient(stack.service.target) as cache:
        for holder in await prefix_holders(cache, salt, names):  # the announce landed: take it back,
            await cache.forget_prefixes(holder, names, scope=salt)  # as if it were still on its way
        assert await cache.find_prefix(names, scope=salt) is None
    history.append(user("second: and another one"))
    async with stack.http() as http:
        routed = await metric(http, PREFIX_HOLDER_ROUTES)
        reply = await chat_turn(client, stack.model, history, conversation_id=None, cache_salt=salt)
        assert await metric(http, PREFIX_HOLDER_ROUTES) == routed + 1  # not least_loaded
    assert reply.cached_tokens >= first.prompt_tokens + len(first.tokens) - 1
    assert reply.tokens == (await stateless_reference(client, stack.model, history)).tokens


async def test_a_shared_system_prompt_is_computed_once_per_scope(stack):
    """8 new chats, explicit conversations and stateless requests in turn, open with the same
    system prompt: all but the first reuse it, whichever kind made it."""
    client, salt = stack.client(), _salt()
    cached = []
    for i in range(8):
        messages = [SYSTEM, user(f"question {i}: how far is {i * 13}?")]
        conversation_id = f"sys-{uuid.uuid4().hex[:8]}" if i % 2 else None
        reply = await chat_turn(client, stack.model, messages, conversation_id=conversation_id, cache_salt=salt)
        reference = await stateless_reference(client, stack.model, messages)
        assert reply.tokens == reference.tokens
        cached.append(reply.cached_tokens)
    assert cached[0] == 0 and min(cached[1:]) >= len(SYSTEM["content"]), cached
    other = await chat_turn(client, stack.model, [SYSTEM, user("question 0: how far is 0?")], conversation_id=None,
                            cache_salt=_salt())
    assert other.cached_tokens == 0  # another salt: another scope


async def test_requests_arriving_together_over_a_prefix_nobody_holds_compute_it_once(stack):
    """Two chats open together with a long system prompt nobody holds yet: the router sends the
    second where the first computes it (prefix_computing), and the engine lets it attach the
    first one's mark instead of computing the prompt a second time elsewhere."""
    client, salt = stack.client(), _salt()
    system = {"role": "system", "content": SYSTEM["content"] * 2}  # 3,132 tokens (the model allows 4,096)
    chats = [[system, user(f"question {i}: how near is {i * 7}?")] for i in range(2)]
    async with stack.http() as http:
        coalesced = await metric(http, PREFIX_COMPUTING_ROUTES)
        replies = await asyncio.gather(*(chat_turn(client, stack.model, chat, conversation_id=None, cache_salt=salt)
                                         for chat in chats))
        assert await metric(http, PREFIX_COMPUTING_ROUTES) == coalesced + 1
    assert sorted(r.cached_tokens >= len(system["content"]) for r in replies) == [False, True], [
        r.cached_tokens for r in replies]
    for chat, reply in zip(chats, replies):
        assert reply.tokens == (await stateless_reference(client, stack.model, chat)).tokens


async def test_a_prefix_whose_holder_died_is_recomputed_with_the_same_tokens(stack):
    client, salt = stack.client(), _salt()
    history = [user("first: name a colour")]
    first = await chat_turn(client, stack.model, history, conversation_id=None, cache_salt=salt)
    history.append({"role": "assistant", "content": first.text})
    async with CacheClient(stack.service.target) as cache:
        (holder,) = await prefix_holders(cache, salt, message_prefix_digests(salt, history))
    kill_replica(APP, holder)
    await replica_replaced(APP)
    history.append(user("second: and another one"))
    reply = await chat_turn(client, stack.model, history, conversation_id=None, cache_salt=salt)
    assert reply.cached_tokens == 0  # the state died with its replica; the index entry only misleads
    assert reply.tokens == (await stateless_reference(client, stack.model, history)).tokens
    history += [{"role": "assistant", "content": reply.text}, user("third: one more")]
    again = await chat_turn(client, stack.model, history, conversation_id=None, cache_salt=salt)
    assert again.cached_tokens >= reply.prompt_tokens + len(reply.tokens) - 1  # the chain goes on
