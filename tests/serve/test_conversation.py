"""Multi-turn conversations over HTTP with the official client: reuse, exactness, isolation."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest
from ray import serve

from deployments.messages import TurnDone, TurnJob
from tests.serve.conftest import APP, SERVED_NAMES
from tests.serve.helpers import chat_turn, conversation, stateless_reference, user

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_five_turns_reuse_the_head_and_match_stateless(stack, conv_id, stream):
    client = stack.client()
    history: list[dict] = []
    for turn in range(1, 6):
        message = user(f"turn {turn}: tell me about the number {turn * 7}")
        # A salt of its own: another run's identical first message would be a shared prefix here.
        reply = await chat_turn(client, stack.model, [message], conversation_id=conv_id, cache_salt=conv_id,
                                stream=stream)
        reference = await stateless_reference(client, stack.model, history + [message])
        assert reply.turn == turn
        assert reply.tokens == reference.tokens and reply.text == reference.text
        assert reply.prompt_tokens == reference.prompt_tokens
        if turn > 1:
            assert reply.cached_tokens > 0, f"turn {turn} reused nothing"
        else:
            assert reply.cached_tokens == 0
        history += [message, {"role": "assistant", "content": reply.text}]


async def test_another_salt_never_sees_the_state(stack, conv_id):
    client = stack.client()
    first = await chat_turn(client, stack.model, [user("a secret: 4711")], conversation_id=conv_id, cache_salt="a")
    other = await chat_turn(client, stack.model, [user("what was the secret?")], conversation_id=conv_id,
                            cache_salt="b")
    assert first.turn == 1 and other.turn == 1  # under salt b this is a new conversation
    assert other.cached_tokens == 0
    alone = await stateless_reference(client, stack.model, [user("what was the secret?")])
    assert other.tokens == alone.tokens
    async with stack.http() as http:
        seen_b = (await http.get(f"/v1/conversations/{conv_id}", params={"cache_salt": "b"})).json()
        assert [m["content"] for m in seen_b["turns"][0]["messages"]][0] == "what was the secret?"
        missing = await http.get(f"/v1/conversations/{conv_id}", params={"cache_salt": "c"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "conversation_not_found"


async def test_stateless_request_and_models(stack):
    client = stack.client()
    models = await client.models.list()
    assert [m.id for m in models.data] == [*SERVED_NAMES, stack.model]  # served_model_name, then the checkpoint's
    reply = await client.chat.completions.create(model=stack.model, messages=[user("hello")], max_tokens=5,
                                                 temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 5 and reply.usage.prompt_tokens > 0
    assert reply.model_extra.get("conversation_id") is None
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="no-such-model", messages=[user("hello")], max_tokens=2)


async def test_new_conversations_spread_and_stay_on_their_owner(stack):
    client = stack.client()
    ids = [f"spread-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    first = await client.chat.completions.create(
        model=stack.model, messages=[user("long one")], max_tokens=300, temperature=0, stream=True,
        extra_body={"conversation_id": ids[0], "cache_salt": "p"})
    chunks = first.__aiter__()
    await chunks.__anext__()  # the first turn runs on its replica before the second one is routed
    second = asyncio.create_task(chat_turn(client, stack.model, [user("long one")], conversation_id=ids[1],
                                           cache_salt="p", max_tokens=300))
    async for _ in chunks:
        pass
    await second
    async with stack.http() as http:
        owners = [(await conversation(http, c, "p"))["head"]["owner"] for c in ids]
        assert owners[0] != owners[1]  # two at once: the second went to the less loaded replica
        for _ in range(2):
            reply = await chat_turn(client, stack.model, [user("again")], conversation_id=ids[0], cache_salt="p")
            assert reply.cached_tokens > 0
        assert (await conversation(http, ids[0], "p"))["head"]["owner"] == owners[0]  # sticky


async def test_simultaneous_new_requests_are_spread(stack):
    """Two requests with no owner enter the router in the same instant (queued before either is
    routed): each choice counts against its replica at once, so the second takes the other one."""
    workers = serve.get_deployment_handle("Worker", app_name=APP).options(stream=True)

    async def replica_of(response) -> str:
        events = [event async for event in response]
        assert isinstance(events[-1], TurnDone), events[-1]
        return events[-1].replica

    for attempt in range(4):
        responses = [workers.run_turn.remote(TurnJob(f"sim-{attempt}-{i}-{uuid.uuid4().hex[:6]}", [user("hi")],
                                                     {"max_tokens": 2, "temperature": 0.0}))
                     for i in range(2)]
        replicas = await asyncio.gather(*(replica_of(r) for r in responses))
        assert replicas[0] != replicas[1], f"attempt {attempt}: both on {replicas[0]}"
