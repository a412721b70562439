"""Scale-in: a worker node is drained (the preemption notice an autoscaler gives before it removes a
machine). Serve starts the node's replica elsewhere and stops it gracefully; the replica hands its
heads to the tier as it goes, so the next turns import them: nothing is recomputed."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest

from tests.multinode.conftest import MultinodeApp
from tests.serve.helpers import Reply, chat_turn, conversation, metric, stateless_reference, user

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(600)]
CONVERSATIONS = 4


async def test_a_drained_node_hands_its_heads_over_through_the_tier(multinode: MultinodeApp):
    stack, cluster = multinode.stack, multinode.cluster
    client = stack.client()
    placement = await multinode.settled()
    multinode.with_spare_node()  # where Serve starts the drained node's replica
    convs = [f"drain-{uuid.uuid4().hex[:8]}" for _ in range(CONVERSATIONS)]
    first = {c: user(f"remember {c}") for c in convs}
    replies = await asyncio.gather(*(chat_turn(client, stack.model, [first[c]], conversation_id=c, cache_salt="d")
                                     for c in convs))
    histories = {c: [first[c], {"role": "assistant", "content": r.text}] for c, r in zip(convs, replies)}
    async with stack.http() as http:
        heads = {c: (await conversation(http, c, "d"))["head"] for c in convs}
        assert all(h["tier_version"] == 0 for h in heads.values())  # the export delay (60 s) holds them back
        drained_replica, _ = Counter(h["owner"] for h in heads.values()).most_common(1)[0]
        drained = placement[drained_replica]
        moving = [c for c in convs if heads[c]["owner"] == drained_replica]
        imports = await metric(http, "hybridserve_tier_imports_total")
        recomputes = await metric(http, "hybridserve_ledger_recomputes_total")

        await asyncio.to_thread(cluster.drain, drained)
        after = await multinode.settled(avoid=drained)
        assert drained_replica not in after

        for c in moving:  # the stopped replica exported each head it alone held
            head = (await conversation(http, c, "d"))["head"]
            assert head["tier_version"] == head["version"] == 1 and head["owner"] == drained_replica

        async def next_turn(c: str) -> Reply:
            return await chat_turn(client, stack.model, [user("what was it?")], conversation_id=c, cache_salt="d")

        for c, reply in zip(convs, await asyncio.gather(*(next_turn(c) for c in convs))):
            assert reply.turn == 2 and reply.cached_tokens > 0, (c, reply)  # imported, or its owner's own
            reference = await stateless_reference(client, stack.model, histories[c] + [user("what was it?")])
            assert reply.tokens == reference.tokens
        assert await metric(http, "hybridserve_tier_imports_total") == imports + len(moving)
        assert await metric(http, "hybridserve_ledger_recomputes_total") == recomputes
    print(f"placement {placement} -> {after}; drained node {drained} with {len(moving)} of {len(convs)} "
          f"conversations; imported from the tier: {len(moving)}")
    await asyncio.to_thread(cluster.nodes[drained].kill)  # the drained machine goes
