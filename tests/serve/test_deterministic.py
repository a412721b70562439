"""`deterministic: true` over HTTP: the same tokens and logprobs, bit for bit, whatever else runs,
on a cache hit or a stateless miss, on either replica."""

from __future__ import annotations

import asyncio

import pytest

from tests.serve.helpers import chat_turn, conversation, stateless_reference, user

pytestmark = pytest.mark.timeout(300)
DET = {"deterministic": True, "seed": 11, "temperature": 0.9, "max_tokens": 24}


async def test_deterministic_turns_are_bit_identical_everywhere(stack, conv_id):
    client = stack.client()
    first, second = user("a deterministic question"), user("and a follow-up")
    # Turn 1 of both at the same instant: the router puts them on different replicas, unless the
    # first ended before the second was routed (then the loads tie): tried again with new ids.
    for attempt in range(4):
        ids = [f"{conv_id}-{attempt}-{side}" for side in ("alone", "busy")]
        ones = await asyncio.gather(*(chat_turn(client, stack.model, [first], conversation_id=c, cache_salt="det",
                                                **DET) for c in ids))
        assert ones[0].tokens == ones[1].tokens and ones[0].logprobs == ones[1].logprobs
        async with stack.http() as http:
            owners = [(await conversation(http, c, "det"))["head"]["owner"] for c in ids]
        if owners[0] != owners[1]:
            break
    assert owners[0] != owners[1]
    alone = await chat_turn(client, stack.model, [second], conversation_id=ids[0], cache_salt="det", **DET)

    # The same turn on the other replica, batched with ordinary sampled traffic (already streaming:
    # the response starts with the first token) spread over both replicas.
    noise = [await client.chat.completions.create(model=stack.model, messages=[user(f"noise {i}")], max_tokens=300,
                                                  temperature=1.0, stream=True) for i in range(4)]
    busy = await chat_turn(client, stack.model, [second], conversation_id=ids[1], cache_salt="det", stream=True,
                           **DET)
    for stream in noise:  # 300 tokens each (the model never ends a reply): longer than `busy`'s turn
        async for _chunk in stream:
            pass
    history = [first, {"role": "assistant", "content": ones[0].text}, second]
    miss = await stateless_reference(client, stack.model, history, **DET)

    assert alone.cached_tokens > 0 and busy.cached_tokens > 0 and miss.cached_tokens == 0
    assert alone.tokens == busy.tokens == miss.tokens
    assert alone.logprobs == busy.logprobs == miss.logprobs  # floats compared exactly
