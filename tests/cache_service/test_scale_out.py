"""Several cache-service processes on one Redis: any answers metadata, tier entries are placed by
rendezvous hashing on two of them, and SIGKILLing one loses no acknowledged turn."""

from __future__ import annotations

import asyncio
import collections
import os
import uuid

import pytest
from cs_helpers import History, ServiceProcess, commit_turn

from cache_service.client import CacheClient, ClientConfig, Interrupted, NotFound, RetryPolicy
from cache_service.placement import prefix_key, rank
from proto.contract import ConversationRef, prefix_scope_tag, tokens_digest

INSTANCES = 3
RENDEZVOUS = {"CACHE_TIER_PLACEMENT": "rendezvous"}


@pytest.fixture
async def fleet(redis_server, tmp_path):
    procs = [ServiceProcess(data_dir=tmp_path / f"instance-{i}", redis_url=redis_server.url, extra_env=RENDEZVOUS)
             for i in range(INSTANCES)]
    try:
        await asyncio.gather(*(asyncio.to_thread(p.start) for p in procs))
        yield procs
    finally:
        for p in procs:
            p.close()


def fleet_client(procs, *, copies: int = 2, dns: bool = False) -> CacheClient:
    """A client of every instance: their addresses, or (`dns`) a name each resolves to."""
    targets = [f"dns:///localhost:{p.port}" if dns else p.target for p in procs]
    return CacheClient(",".join(targets), ClientConfig(
        timeout_s=5.0, retry=RetryPolicy(attempts=100, initial_backoff_s=0.01, max_backoff_s=0.25),
        tier_copies=copies))


def single_clients(procs) -> list[CacheClient]:
    """One client per instance, to ask each what it holds."""
    return [CacheClient(p.target) for p in procs]


def new_conv() -> ConversationRef:
    return ConversationRef(f"conv-{uuid.uuid4().hex}", salt="scale-out")


def spread_over(targets: list[str], per_instance_left_out: int) -> list[ConversationRef]:
    """Conversations each instance ranks last for exactly `per_instance_left_out` of: chosen so,
    not drawn at random and hoped to spread (24 random ones leave one instance out of 17 or more
    once in 1,700 runs)."""
    chosen: dict[str, list[ConversationRef]] = {t: [] for t in targets}
    for _ in range(100 * len(targets) * per_instance_left_out):
        conv = new_conv()
        left_out = chosen[rank(conv.key, targets)[-1]]
        if len(left_out) < per_instance_left_out:
            left_out.append(conv)
        if all(len(c) == per_instance_left_out for c in chosen.values()):
            return [conv for group in zip(*chosen.values()) for conv in group]
    raise AssertionError("rendezvous ranking never left some instance out")


async def holders(clients: list[CacheClient], procs, conv: ConversationRef) -> set[str]:
    held = set()
    for client, proc in zip(clients, procs):
        try:
            await client.get_state(conv)
            held.add(proc.target)
        except NotFound:
            pass
    return held


async def test_any_instance_answers_every_metadata_call(fleet):
    a, b, c = single_clients(fleet)
    conv = new_conv()
    try:
        lease = await a.acquire_lease(conv, ttl_ms=10_000)
        await b.renew_lease(conv, lease, ttl_ms=10_000)
        head = await c.publish_turn(conv, lease_token=lease, expected_version=0, messages=[
            {"role": "user", "content": "hi"}], token_ids=[1, 2], committed_tokens=2,
            tokens_sha256=tokens_digest([1, 2]), release_lease=False)
        assert head.version == 1
        assert (await a.get_head(conv)).version == (await b.read_ledger(conv)).head.version == 1
        await c.release_lease(conv, lease)
        assert (await b.acquire_lease(conv, ttl_ms=1000)).head.version == 1
        await a.announce_prefixes("replica-x", [("ab" * 16, 7)])
        assert (await c.find_prefix(["ab" * 16])).holders == (("replica-x", 7),)
        async with fleet_client(fleet) as client:  # a client of them all: one of them answers
            assert (await client.get_head(conv)).version == 1
            assert await client.delete_conversation(conv)
    finally:
        await asyncio.gather(*(x.close() for x in (a, b, c)))


async def test_entries_live_on_their_two_ranked_instances_and_spread_over_all(fleet):
    targets = [p.target for p in fleet]
    peers = single_clients(fleet)
    async with fleet_client(fleet, dns=True) as client:  # localhost resolves to 127.0.0.1: the targets
        convs = spread_over(targets, per_instance_left_out=8)
        for i, conv in enumerate(convs):
            history = History()
            await commit_turn(client, conv, history, [i + 1], "t")
            await client.put_state(conv, await client.get_head(conv), [os.urandom(1000), os.urandom(500)])
        per_instance = collections.Counter()
        for conv in convs:
            held = await holders(peers, fleet, conv)
            assert held == set(rank(conv.key, targets)[:2])
            per_instance.update(held)
            # Whichever instance answers, the head names the version the tier holds.
            for peer in peers:
                head = await peer.get_head(conv)
                assert head.tier_version == head.version == 1
            assert (await client.get_state(conv, 1))[0] == 1
        assert per_instance == {t: 16 for t in targets}, per_instance  # each holds the 16 it ranks in the first two
        stats = [await peer.stats() for peer in peers]
        assert sum(s.tier_entries for s in stats) == 2 * len(convs)
        # A deleted conversation leaves no copy behind.
        assert await client.delete_conversation(convs[0])
        assert await holders(peers, fleet, convs[0]) == set()
    await asyncio.gather(*(p.close() for p in peers))


async def test_a_prefix_checkpoint_lives_on_the_two_instances_ranked_for_its_scope_and_name(fleet):
    targets, peers = [p.target for p in fleet], single_clients(fleet)
    scope, names = "tenant-scale-out", [uuid.uuid4().hex for _ in range(6)]
    async with fleet_client(fleet) as client:
        for name in names:
            await client.put_prefix_state(scope, name, 64, [b"system prompt" * 100, name.encode()])
        for name in names:
            held = set()
            for peer, target in zip(peers, targets):
                try:
                    await peer.get_prefix_state(scope, name)
                    held.add(target)
                except NotFound:
                    pass
            assert held == set(rank(prefix_key(prefix_scope_tag(scope), name), targets)[:2])
            assert await client.get_prefix_state(scope, name) == b"system prompt" * 100 + name.encode()
            match = await client.find_prefix([name], scope=scope)
            assert match.holders == () and match.tier == (name, 64)
    await asyncio.gather(*(p.close() for p in peers))


async def turns(client: CacheClient, conv: ConversationRef, history: History, acked: list[int], count: int,
                progress: asyncio.Event | None = None) -> None:
    """`count` turns: acquire, publish (retried with its publish_id on a cut call: the ledger's
    verdict), export. Each acknowledged version is appended to `acked`."""
    for n in range(count):
        lease = await client.acquire_lease(conv, ttl_ms=10_000, wait_s=5.0)
        new = [len(history.tokens) + 1, n]
        tokens = history.tokens + new
        publish_id = uuid.uuid4().hex
        for _ in range(3):
            try:
                head = await client.publish_turn(
                    conv, lease_token=lease, expected_version=history.version,
                    messages=[{"role": "user", "content": f"turn {n}"}], token_ids=new,
                    committed_tokens=len(tokens), tokens_sha256=tokens_digest(tokens), publish_id=publish_id)
                break
            except Interrupted:
                continue
        history.tokens, history.version = tokens, head.version
        acked.append(head.version)
        await client.put_state(conv, head, [bytes([n]) * 4000, os.urandom(2000)])
        if progress is not None:
            progress.set()


async def test_sigkilled_instance_loses_no_acknowledged_turn_and_the_others_serve_on(fleet):
    targets = [p.target for p in fleet]
    victim = fleet[1]
    async with fleet_client(fleet) as client, fleet_client(fleet, copies=1) as one_copy:
        # Idle conversations whose entry's first instance is the victim: with a copy, and without.
        copied, lone = [], []
        while len(copied) < 4 or len(lone) < 4:
            conv = new_conv()
            if rank(conv.key, targets)[0] != victim.target:
                continue
            writer, group = (client, copied) if len(copied) < 4 else (one_copy, lone)
            history = History()
            await commit_turn(writer, conv, history, [1, 2, 3], "idle")
            await writer.put_state(conv, await writer.get_head(conv), b"idle state " * 100)
            group.append(conv)

        busy = [new_conv() for _ in range(12)]
        histories = {conv: History() for conv in busy}
        acked = {conv: [] for conv in busy}
        before = 2
        await asyncio.gather(*(turns(client, c, histories[c], acked[c], before) for c in busy))
        progress = asyncio.Event()
        load = asyncio.gather(*(turns(client, c, histories[c], acked[c], 4, progress) for c in busy))
        await progress.wait()  # mid-load: turns are running on every instance
        await asyncio.to_thread(victim.kill)
        await asyncio.wait_for(load, 60)

        for conv in busy:
            assert acked[conv] == list(range(1, before + 5))
            ledger = await client.read_ledger(conv)
            committed = [t for turn in ledger.turns for t in turn.token_ids]
            assert ledger.head.version == acked[conv][-1] and committed == histories[conv].tokens
            head = ledger.head
            assert head.tier_version == head.version  # exported after the kill: on live instances
            version, _ = await asyncio.wait_for(client.get_state(conv, head.tier_version,
                                                                 incarnation=head.incarnation), 10)
            assert version == head.version
        for conv in copied:  # the victim held it first: the copy on the next instance answers
            version, data = await asyncio.wait_for(client.get_state(conv, 1), 10)
            assert (version, data) == (1, b"idle state " * 100)
        for conv in lone:  # its only copy died: a clear miss (the worker recomputes), no hang
            head = await client.get_head(conv)
            assert head.tier_version == 1  # Redis still records the export
            with pytest.raises(NotFound):
                await asyncio.wait_for(one_copy.get_state(conv, head.tier_version), 10)
        # Fresh clients pick their metadata instance at random: those that pick the dead one move on.
        for _ in range(20):
            async with fleet_client(fleet) as fresh:
                head = await asyncio.wait_for(fresh.get_head(busy[0]), 10)
                assert head.version == acked[busy[0]][-1]
