"""What a client is told is what the ledger holds: idempotent retries, a lost lease stops its
turn, a turn whose worker died after publishing is answered from the ledger."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import openai
from ray import serve

from deployments.messages import ReplicaCall

from tests.serve.conftest import APP, NOTIER_APP
from tests.serve.helpers import chat_turn, conversation, metric, user
from tests.serve.test_recovery import kill_replica, replica_replaced, replicas_settled


def body(model: str, conv_id: str, text: str, **extra) -> dict:
    return {"model": model, "messages": [user(text)], "max_tokens": 8, "temperature": 0,
            "conversation_id": conv_id, "cache_salt": "i", **extra}


async def test_a_retry_with_the_same_idempotency_key_is_answered_not_run_again(stack, conv_id):
    async with stack.http() as http:
        headers = {"Idempotency-Key": f"key-{conv_id}"}
        first = await http.post("/v1/chat/completions", json=body(stack.model, conv_id, "hello"), headers=headers)
        assert first.status_code == 200, first.text
        again = await http.post("/v1/chat/completions", json=body(stack.model, conv_id, "hello"), headers=headers)
        assert again.status_code == 200, again.text
        a, b = first.json(), again.json()
        assert b["choices"][0]["message"] == a["choices"][0]["message"]
        assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
        assert b["usage"] == a["usage"]
        assert b["turn"] == a["turn"] == 1
        # the stream of a retry carries the same reply
        streamed = await http.post("/v1/chat/completions", json=body(stack.model, conv_id, "hello", stream=True),
                                   headers=headers)
        assert a["choices"][0]["message"]["content"] == "".join(
            chunk["choices"][0]["delta"].get("content") or "" for chunk in _events(streamed.text) if chunk["choices"])
        # the same key with another request is refused, and runs nothing
        other = await http.post("/v1/chat/completions", json=body(stack.model, conv_id, "goodbye"), headers=headers)
        assert other.status_code == 422, other.text
        assert other.json()["error"]["code"] == "idempotency_key_reused"
        # a new key is a new turn
        third = await http.post("/v1/chat/completions", json=body(stack.model, conv_id, "goodbye"),
                                headers={"Idempotency-Key": f"other-{conv_id}"})
        assert third.status_code == 200 and third.json()["turn"] == 2
        ledger = await conversation(http, conv_id, "i")
        assert [t["messages"][0]["content"] for t in ledger["turns"]] == ["hello", "goodbye"]


async def test_concurrent_duplicates_run_one_turn(stack, conv_id):
    """The official client's way to send a key; both copies answered alike, one turn in the ledger."""
    client = stack.client()
    key = {"Idempotency-Key": f"dup-{conv_id}"}
    replies = await asyncio.gather(*(
        chat_turn(client, stack.model, [user("at once")], conversation_id=conv_id, cache_salt="i",
                  wait_if_busy=True, headers=key, stream=stream) for stream in (False, True)))
    assert replies[0].text == replies[1].text and replies[0].turn == replies[1].turn == 1
    async with stack.http() as http:
        assert len((await conversation(http, conv_id, "i"))["turns"]) == 1


async def test_a_lost_lease_stops_the_turn_at_once(stack, notier, conv_id):
    """Redis paused past the 1.5 s lease: the renewal finds the lease gone, and the turn stops
    then instead of generating its 3,600 tokens for a publish that must fail."""
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}{notier}/v1", api_key="k1", max_retries=0, timeout=120)
    await replicas_settled(NOTIER_APP)
    stream = await client.chat.completions.create(
        model=stack.model, messages=[user("a long one")], max_tokens=3600, temperature=0, stream=True,
        extra_body={"conversation_id": conv_id, "cache_salt": "l"})
    chunks, error, resumed = 0, None, None
    try:
        async for _chunk in stream:
            chunks += 1
            if chunks == 5:
                os.kill(stack.redis.pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(3.0)  # the fault itself: Redis hangs twice the lease's TTL
                finally:
                    os.kill(stack.redis.pid, signal.SIGCONT)
                resumed = time.monotonic()
    except openai.APIError as e:
        error = e
    assert error is not None, f"the turn streamed {chunks} chunks and ended without an error"
    assert chunks < 3600
    stopped_after = time.monotonic() - resumed
    assert stopped_after < 5.0, f"the turn ran on {stopped_after:.1f} s after its lease was lost"
    async with stack.http() as http:
        ledger = await http.get(f"/notier/v1/conversations/{conv_id}", params={"cache_salt": "l"},
                                headers={"Authorization": "Bearer k1"})
        assert ledger.status_code == 404  # nothing was committed


async def test_a_worker_killed_mid_turn_is_retried_under_one_run_per_lease(stack, conv_id):
    """The owner dies while the next turn streams: the client is told what the ledger holds,
    and a retry with the same key gets the turn exactly once."""
    client = stack.client()
    key = {"Idempotency-Key": f"kill-{conv_id}"}
    first = await chat_turn(client, stack.model, [user("one")], conversation_id=conv_id, cache_salt="i")
    async with stack.http() as http:
        owner = (await conversation(http, conv_id, "i"))["head"]["owner"]
    stream = await client.chat.completions.create(
        model=stack.model, messages=[user("two")], max_tokens=600, temperature=0, stream=True,
        extra_body={"conversation_id": conv_id, "cache_salt": "i"}, extra_headers=key)
    told = None
    try:
        async for chunk in stream:
            if told is None:
                told = "streaming"
                await asyncio.to_thread(kill_replica, APP, owner)
            if chunk.choices and chunk.choices[0].finish_reason:
                told = "committed"
    except openai.APIError:
        told = "failed"
    retry = await chat_turn(client, stack.model, [user("two")], conversation_id=conv_id, cache_salt="i",
                            max_tokens=600, wait_if_busy=True, headers=key)
    async with stack.http() as http:
        ledger = await conversation(http, conv_id, "i")
    assert [t["messages"][0]["content"] for t in ledger["turns"]] == ["one", "two"], told
    assert retry.turn == 2 and first.turn == 1
    await replica_replaced(APP)


def _events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


async def test_with_the_tier_off_no_export_is_left_pending(stack, notier, conv_id):
    """Every committed head used to wait in the worker for an export that, with the tier off,
    never came: one entry per conversation, for the replica's life."""
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}{notier}/v1", api_key="k2", max_retries=0, timeout=120)
    await replicas_settled(NOTIER_APP)
    await chat_turn(client, stack.model, [user("kept nowhere else")], conversation_id=conv_id, cache_salt="p")
    async with stack.http() as http:
        head = (await conversation(http, conv_id, "p", prefix=notier, headers={"Authorization": "Bearer k2"}))["head"]
    workers = serve.get_deployment_handle("Worker", app_name=NOTIER_APP)
    assert await workers.pending_exports.remote(ReplicaCall(head["owner"])) == (head["owner"], 0)


async def test_clients_that_hang_up_leave_nothing_in_flight(stack, conv_id):
    """A stream's generator left suspended when its client hung up kept its slot of
    `max_inflight` (and its lease) until the garbage collector closed it: a chaos run ended
    with every request answered 503 "too many requests in flight"."""
    client = stack.client()
    async with stack.http() as http:  # other tests' requests may still be finishing: not below this
        before = await metric(http, "hybridserve_inflight_requests")
    for i in range(4):
        stream = await client.chat.completions.create(
            model=stack.model, messages=[user("never mind")], max_tokens=3000, temperature=0, stream=True,
            extra_body={"conversation_id": f"{conv_id}-{i}", "cache_salt": "h"})
        async for _chunk in stream:
            break
        await stream.close()
    async with stack.http() as http:
        async def settled() -> None:  # the ingress settles a hung-up turn on its own time: polled
            while await metric(http, "hybridserve_inflight_requests") > before:
                await asyncio.sleep(0.1)

        await asyncio.wait_for(settled(), 30)
        for i in range(4):  # and the leases went with them: each conversation takes a turn at once
            r = await http.post("/v1/chat/completions", json=body(stack.model, f"{conv_id}-{i}", "again") | {
                "cache_salt": "h"})
            assert r.status_code == 200, r.text
