"""A worker node dies (raylet and every process on it, SIGKILL) while every conversation streams a
turn: no conversation is lost, the clients were told what the ledger holds, Serve replaces the
replica on the spare node, and the metrics say where the recovered heads came from."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import openai
import pytest

from tests.multinode.conftest import MultinodeApp
from tests.serve.helpers import Reply, chat_turn, conversation, metric, stateless_reference, user

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(600)]
CONVERSATIONS = 6
LONG_REPLY = 1500  # tokens: still streaming when the node dies (a few hundred tokens/s here)


async def stream_turn(client, model: str, conv: str, message: dict, flowing: asyncio.Event) -> Reply | Exception:
    """A turn streamed to its end, or the error that cut it; `flowing` is set at its first token."""
    try:
        chunks = await client.chat.completions.create(
            model=model, messages=[message], max_tokens=LONG_REPLY, temperature=0, stream=True, logprobs=True,
            top_logprobs=0, extra_body={"conversation_id": conv, "cache_salt": "n"})
        text, tokens, turn = [], [], None
        async for chunk in chunks:
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                tokens += [t.token for t in (choice.logprobs.content if choice.logprobs else None) or []]
            turn = (chunk.model_extra or {}).get("turn", turn)
            if tokens:
                flowing.set()
        return Reply("".join(text), tokens, "length", 0, 0, turn, [])
    except openai.APIError as error:
        return error
    finally:
        flowing.set()  # a turn refused at once must not hold up the kill


async def test_a_lost_worker_node_loses_no_conversation(multinode: MultinodeApp):
    stack, cluster = multinode.stack, multinode.cluster
    client = stack.client()
    placement = await multinode.settled()
    assert "head" not in placement.values()  # two replicas, two worker nodes (settled says so)
    multinode.with_spare_node()  # where Serve starts the lost node's replica again
    convs = [f"node-loss-{uuid.uuid4().hex[:8]}" for _ in range(CONVERSATIONS)]
    histories: dict[str, list[dict]] = {c: [] for c in convs}

    async def turn(conv: str, text: str) -> Reply:
        reply = await chat_turn(client, stack.model, [user(text)], conversation_id=conv, cache_salt="n")
        histories[conv] += [user(text), {"role": "assistant", "content": reply.text}]
        return reply

    await asyncio.gather(*(turn(c, f"first question of {c}") for c in convs))
    async with stack.http() as http:
        owners = {c: (await conversation(http, c, "n"))["head"]["owner"] for c in convs}
        victim_replica, _ = Counter(owners.values()).most_common(1)[0]
        victim = placement[victim_replica]
        lost = [c for c in convs if owners[c] == victim_replica]
        kept = [c for c in convs if c not in lost]
        recomputes = await metric(http, "hybridserve_ledger_recomputes_total")
        imports = await metric(http, "hybridserve_tier_imports_total")

        # Every conversation streams its second turn; the node dies once all of them have tokens.
        second = {c: user(f"second question of {c}, at length") for c in convs}
        flowing = {c: asyncio.Event() for c in convs}
        streams = {c: asyncio.create_task(stream_turn(client, stack.model, c, second[c], flowing[c])) for c in convs}
        await asyncio.gather(*(e.wait() for e in flowing.values()))
        await asyncio.to_thread(cluster.nodes[victim].kill)
        results = dict(zip(convs, await asyncio.gather(*streams.values())))
        for c in lost:  # cut mid-stream: nothing of it committed
            assert isinstance(results[c], openai.APIError), (c, results[c])
        for c in kept:  # the surviving node finished its turns
            assert isinstance(results[c], Reply) and results[c].turn == 2 and len(results[c].tokens) == LONG_REPLY
            histories[c] += [second[c], {"role": "assistant", "content": results[c].text}]

        # Serve notices the dead node (the GCS's missed heartbeats) and places the lost replica on
        # the spare node: the dead node's `hs_worker` is gone with it.
        after = await multinode.settled(avoid=victim)
        assert victim_replica not in after and victim not in after.values()

        # The cut turns, sent again, run on the surviving nodes from the ledger (no tier copy: the
        # export delay outlasts the test); the others go on where they were.
        retries = await asyncio.gather(*(chat_turn(client, stack.model, [second[c]], conversation_id=c,
                                                   cache_salt="n") for c in lost))
        for c, reply in zip(lost, retries):
            assert reply.turn == 2 and reply.cached_tokens == 0
            reference = await stateless_reference(client, stack.model, histories[c] + [second[c]])
            assert reply.tokens == reference.tokens
            histories[c] += [second[c], {"role": "assistant", "content": reply.text}]
        for c in kept:
            reply = await turn(c, "third question")
            assert reply.turn == 3 and reply.cached_tokens > 0  # its owner's own head

        assert await metric(http, "hybridserve_ledger_recomputes_total") == recomputes + len(lost)
        assert await metric(http, "hybridserve_tier_imports_total") == imports

        print(f"placement {placement} -> {after}; killed node {victim} with {len(lost)} of {len(convs)} "
              f"conversations; recomputed from the ledger: {len(lost)}")
        for c in convs:  # what each client was told is what the ledger holds, turn by turn
            ledger = await conversation(http, c, "n")
            told = [histories[c][i:i + 2] for i in range(0, len(histories[c]), 2)]
            assert [t["messages"] for t in ledger["turns"]] == told
            assert ledger["head"]["owner"] in after
