"""A head moving between replicas without a crash: the owner is full, or it shut down gracefully;
and DELETE freeing the owner's local copy."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from ray import serve

from deployments.app import ChatIngress, Worker
from deployments.messages import HeadRef, ReplicaCall
from deployments.settings import AppSettings
from proto.contract import ConversationRef
from tests.serve.conftest import APP, app_args
from tests.serve.helpers import chat_turn, conversation, metric, stateless_reference, tier_copy, user

pytestmark = pytest.mark.timeout(300)
DRAIN_APP = "hybridserve-drain"
WORKER_MAX_ONGOING = Worker.max_ongoing_requests


async def owned_by(http, client, model, owner: str, count: int) -> list[str]:
    """`count` new conversations whose heads live on `owner`: new conversations arrive in pairs,
    and a pair is spread over the two replicas, so about one of each pair lands there."""
    owned: list[str] = []
    for _ in range(4 * count):
        ids = [f"fill-{uuid.uuid4().hex[:8]}" for _ in range(2)]
        await asyncio.gather(*(chat_turn(client, model, [user("fill")], conversation_id=c, cache_salt="f",
                                         max_tokens=16) for c in ids))
        owned += [c for c in ids if (await conversation(http, c, "f"))["head"]["owner"] == owner]
        if len(owned) >= count:
            return owned[:count]
    raise AssertionError(f"only {len(owned)} of {count} new conversations landed on {owner}")


async def routed_to_owner(http) -> float:
    text = (await http.get("/metrics")).text
    line = 'hybridserve_route_decisions_total{reason="owner"} '
    return next(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


async def fill(http, client, model, fillers: list[str]) -> list:
    """A long turn of each of `fillers` (conversations one replica owns) running on that replica.
    The router moves a turn when its owner's queue, as last reported, costs more than importing
    the head, as it may while these turns arrive one after another: such a turn is closed (nothing
    commits) and sent again until it is routed to its owner."""
    streams = []
    for conv in fillers:
        for _ in range(20):
            before = await routed_to_owner(http)
            stream = await client.chat.completions.create(  # returns once the turn has run its first step
                model=model, messages=[user("go on")], max_tokens=1500, temperature=0, stream=True,
                extra_body={"conversation_id": conv, "cache_salt": "f"})
            if await routed_to_owner(http) > before:
                streams.append(stream)
                break
            await stream.close()
        else:
            raise AssertionError(f"{conv}'s turns never went to its owner")
    return streams


async def test_full_owner_hands_the_turn_to_another_replica(stack, conv_id):
    client = stack.client()
    history = [user("the first question")]
    first = await chat_turn(client, stack.model, history, conversation_id=conv_id, cache_salt="m")
    history.append({"role": "assistant", "content": first.text})
    async with stack.http() as http:
        owner = (await tier_copy(http, conv_id, "m"))["head"]["owner"]
        fillers = await owned_by(http, client, stack.model, owner, WORKER_MAX_ONGOING)
        # Every slot of the owner busy with a long turn of a conversation it owns...
        streams = await fill(http, client, stack.model, fillers)
        migrations = await metric(http, "hybridserve_migrations_total")
        # ... so the next turn of conv_id goes elsewhere and gets the head by the recovery ladder.
        message = user("the second question")
        reply = await chat_turn(client, stack.model, [message], conversation_id=conv_id, cache_salt="m")
        for s in streams:
            await s.close()
        after = await conversation(http, conv_id, "m")
        assert after["head"]["owner"] != owner and reply.turn == 2
        assert reply.cached_tokens > 0  # imported from the tier, not recomputed
        assert await metric(http, "hybridserve_migrations_total") == migrations + 1
    reference = await stateless_reference(client, stack.model, history + [message])
    assert reply.tokens == reference.tokens


async def test_graceful_shutdown_exports_heads_the_tier_lacks(stack, conv_id):
    # An app whose single worker would export only after a minute of quiet: only the shutdown can.
    settings = AppSettings.model_validate(app_args(stack.model_dir, stack.service, tier_export="async",
                                                   tier_export_delay_s=60))
    serve.run(ChatIngress.bind(settings, Worker.options(num_replicas=1).bind(settings, None), None),
              name=DRAIN_APP, route_prefix="/drain")
    client = stack.client("/drain")
    history = [user("remember this")]
    first = await chat_turn(client, stack.model, history, conversation_id=conv_id, cache_salt="g")
    history.append({"role": "assistant", "content": first.text})
    async with stack.http() as http:
        assert (await conversation(http, conv_id, "g"))["head"]["tier_version"] == 0
        await asyncio.to_thread(serve.delete, DRAIN_APP)  # scale-in: the replica shuts down gracefully
        state = await conversation(http, conv_id, "g")
        assert state["head"]["tier_version"] == state["head"]["version"] == 1
        imports = await metric(http, "hybridserve_tier_imports_total")
        message = user("what was it?")
        reply = await chat_turn(stack.client(), stack.model, [message], conversation_id=conv_id, cache_salt="g")
        assert reply.turn == 2 and reply.cached_tokens > 0
        assert await metric(http, "hybridserve_tier_imports_total") == imports + 1
    reference = await stateless_reference(stack.client(), stack.model, history + [message])
    assert reply.tokens == reference.tokens


def _head_ref(state: dict) -> HeadRef:
    h = state["head"]
    return HeadRef(h["version"], h["turn"], h["committed_tokens"], h["tokens_sha256"], h["owner"], h["tier_version"])


async def test_delete_frees_the_owners_local_heads_and_a_late_forget_spares_a_recreated_one(stack, conv_id):
    """DELETE frees the owner's copy of the conversation. The owner's `forget` names the deleted
    head: arriving after the conversation was re-created under the same id and salt (and its
    first turn committed there), it leaves the new head alone."""
    workers, conv = serve.get_deployment_handle("Worker", app_name=APP), ConversationRef(conv_id, "d")
    async with stack.http() as http:
        await chat_turn(stack.client(), stack.model, [user("short lived")], conversation_id=conv_id, cache_salt="d")
        old = _head_ref(await conversation(http, conv_id, "d"))
        assert await workers.held_heads.remote(ReplicaCall(old.owner), conv) == (old.owner, 1)
        deleted = await http.delete(f"/v1/conversations/{conv_id}", params={"cache_salt": "d"})
        assert deleted.status_code == 200, deleted.text
        assert await workers.held_heads.remote(ReplicaCall(old.owner), conv) == (old.owner, 0)

        await chat_turn(stack.client(), stack.model, [user("born again")], conversation_id=conv_id, cache_salt="d")
        new = _head_ref(await conversation(http, conv_id, "d"))
        assert (new.version, new.turn) == (old.version, old.turn) and new.tokens_sha256 != old.tokens_sha256
        assert await workers.forget.remote(ReplicaCall(new.owner), conv, old) == new.owner
        assert await workers.held_heads.remote(ReplicaCall(new.owner), conv) == (new.owner, 1)
        assert await workers.forget.remote(ReplicaCall(new.owner), conv, new) == new.owner
        assert await workers.held_heads.remote(ReplicaCall(new.owner), conv) == (new.owner, 0)
