"""A Redis Cluster primary is killed mid-load: its replica takes over and no acknowledged turn is lost.

Three primaries with two replicas each (redis_cluster_set.py); the real `python -m cache_service`
on the cluster answers a ledger write only once a replica has it (CACHE_PUBLISH_WAIT_REPLICAS=1,
WAIT on the slot's primary). Every client has a conversation on the primary that is SIGKILLed.
Two replicas, so that the promoted one still has a replica to acknowledge writes.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

from cs_helpers import ServiceProcess, fast_client
from failover_load import (CLIENTS, CONVERSATIONS_PER_CLIENT, LOAD_DEADLINE_S, TURNS_BEFORE_KILL, Conversation, Load,
                           client_loop)
from redis_cluster_set import RedisClusterSet

from cache_service.client import CacheClient
from cache_service.client_config import ClientConfig, RetryPolicy
from cache_service.keys import ConversationKeys
from proto.contract import ConversationRef


async def test_service_follows_a_cluster_failover_and_keeps_every_acknowledged_turn(tmp_path):
    with RedisClusterSet(tmp_path, replicas_per_primary=2) as cluster:
        r = cluster.client()
        slot_of = lambda ref: r.keyslot(ConversationKeys.of(ref).head)  # noqa: E731
        refs = (ConversationRef(f"cluster-failover-{n}-{uuid.uuid4().hex[:6]}") for n in itertools.count())
        first = next(refs)
        victim, replicas = cluster.nodes_of_slot(slot_of(first))
        on_victim = (ref for ref in refs if cluster.node_of_slot(slot_of(ref)) is victim)
        # each client: one conversation on the primary that dies, the others wherever they hash
        convs = [[Conversation(next(on_victim))] + [Conversation(next(refs)) for _ in range(CONVERSATIONS_PER_CLIENT - 1)]
                 for _ in range(CLIENTS)]
        service = ServiceProcess(data_dir=tmp_path / "service", redis_url=None, extra_env={
            "REDIS_CLUSTER": cluster.addresses, "CACHE_PUBLISH_WAIT_REPLICAS": "1",
            "CACHE_PUBLISH_WAIT_TIMEOUT_MS": "2000"})
        service.start()
        try:
            impatient = CacheClient(service.target, ClientConfig(timeout_s=5.0, retry=RetryPolicy(attempts=1)))
            async with fast_client(service.target) as client, impatient:
                await client.wait_ready()
                load = Load()
                clients = asyncio.gather(*(client_loop(client if c % 2 else impatient, client, mine, load)
                                           for c, mine in enumerate(convs)))

                async def kill_primary_mid_load():
                    await load.enough_before_kill.wait()
                    acked_at_kill = load.acked
                    victim.kill()
                    promoted = await asyncio.to_thread(cluster.promoted, replicas)
                    load.failed_over.set()
                    return acked_at_kill, promoted

                (acked_at_kill, promoted), _ = await asyncio.wait_for(
                    asyncio.gather(kill_primary_mid_load(), clients), LOAD_DEADLINE_S)

                assert acked_at_kill >= TURNS_BEFORE_KILL
                assert load.acked > acked_at_kill  # later turns succeeded, on the promoted replica too
                # (Whether an impatient client saw an error depends on where its turns were when the
                # primary died: usually a few did, and their turns got the ledger's verdict.)
                for conv in (c for mine in convs for c in mine):
                    ledger = await client.read_ledger(conv.ref)
                    assert [t.publish_id for t in ledger.turns] == conv.publish_ids
                    assert ledger.head.committed_tokens == len(conv.tokens)
                # The dead primary's conversations live on the replica that took over, complete.
                for conv in (mine[0] for mine in convs):
                    head = promoted.client().hget(ConversationKeys.of(conv.ref).head, "version")
                    assert int(head) == len(conv.publish_ids)
                print(f"acked {load.acked} turns ({acked_at_kill} before the kill), "
                      f"{load.in_flight_errors} errors resolved from the ledger ({load.resolved_present} present)")
        finally:
            service.close()
            r.close()
