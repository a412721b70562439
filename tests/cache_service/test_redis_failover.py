"""Redis under Sentinel: the primary is killed mid-load and no acknowledged turn is lost.

A real primary, two replicas and three sentinels (redis_sentinel_set.py); the real
`python -m cache_service` finds the primary through the sentinels and answers a ledger write
only once a replica has it (CACHE_PUBLISH_WAIT_REPLICAS=1). Clients run turns (acquire ->
publish) while the primary is SIGKILLed. Two replicas, so that after the failover the
promoted one still has a replica to acknowledge writes.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from cs_helpers import SERVICE_ROOT, ServiceProcess, fast_client
from failover_load import (CLIENTS, CONVERSATIONS_PER_CLIENT, LOAD_DEADLINE_S, TURNS_BEFORE_KILL, Conversation, Load,
                           client_loop)
from redis_sentinel_set import MASTER_NAME, RedisSentinelSet

from cache_service.client import CacheClient
from cache_service.client_config import ClientConfig, RetryPolicy
from cache_service.errors import Unavailable
from cache_service.launch import CacheServiceChild, ServiceDidNotStart
from cache_service.keys import ConversationKeys
from proto.contract import ConversationRef, tokens_digest


async def test_service_follows_a_sentinel_failover_and_keeps_every_acknowledged_turn(tmp_path):
    with RedisSentinelSet(tmp_path) as redis_set:
        service = ServiceProcess(data_dir=tmp_path / "service", redis_url=None, extra_env={
            "REDIS_SENTINELS": redis_set.sentinel_addresses, "REDIS_MASTER_NAME": MASTER_NAME,
            "CACHE_PUBLISH_WAIT_REPLICAS": "1", "CACHE_PUBLISH_WAIT_TIMEOUT_MS": "2000"})
        service.start()
        try:
            # Half the clients retry for a long while (their turns mostly just succeed), half
            # not at all (their turns in flight get the error, and the ledger's verdict).
            impatient = CacheClient(service.target, ClientConfig(timeout_s=5.0, retry=RetryPolicy(attempts=1)))
            async with fast_client(service.target) as client, impatient:
                await client.wait_ready()
                load = Load()
                convs = [[Conversation(ConversationRef(f"failover-{c}-{i}-{uuid.uuid4().hex[:6]}"))
                          for i in range(CONVERSATIONS_PER_CLIENT)] for c in range(CLIENTS)]
                clients = asyncio.gather(*(client_loop(client if c % 2 else impatient, client, mine, load)
                                           for c, mine in enumerate(convs)))

                async def kill_primary_mid_load():
                    await load.enough_before_kill.wait()
                    acked_at_kill = load.acked
                    redis_set.primary.kill()
                    promoted = await asyncio.to_thread(redis_set.promoted)
                    load.failed_over.set()
                    return acked_at_kill, promoted

                (acked_at_kill, promoted), _ = await asyncio.wait_for(
                    asyncio.gather(kill_primary_mid_load(), clients), LOAD_DEADLINE_S)

                assert acked_at_kill >= TURNS_BEFORE_KILL
                assert load.acked > acked_at_kill  # later turns succeeded on the promoted replica
                assert load.in_flight_errors > 0   # the impatient clients saw the failover
                # Every turn the service acknowledged (or the ledger showed present) is in the
                # ledger after the failover, once, in order; nothing else is.
                for conv in (c for mine in convs for c in mine):
                    ledger = await client.read_ledger(conv.ref)
                    assert [t.publish_id for t in ledger.turns] == conv.publish_ids
                    assert ledger.head.committed_tokens == len(conv.tokens)
                # ... and it is the promoted replica that holds it: the service followed the failover.
                promoted_redis = promoted.client()
                for conv in (c for mine in convs for c in mine):
                    head = promoted_redis.hget(ConversationKeys.of(conv.ref).head, "version")
                    assert int(head) == len(conv.publish_ids)
                print(f"acked {load.acked} turns ({acked_at_kill} before the kill), "
                      f"{load.in_flight_errors} errors resolved from the ledger ({load.resolved_present} present)")
        finally:
            service.close()


async def test_a_write_no_replica_acknowledged_is_unavailable_and_its_retry_resolves_it(tmp_path):
    with RedisSentinelSet(tmp_path, replicas=1, with_sentinels=False) as redis_set:
        service = ServiceProcess(data_dir=tmp_path / "service", redis_url=f"redis://127.0.0.1:{redis_set.primary.port}/0",
                                 extra_env={"CACHE_PUBLISH_WAIT_REPLICAS": "1", "CACHE_PUBLISH_WAIT_TIMEOUT_MS": "300"})
        service.start()
        try:
            impatient = CacheClient(service.target, ClientConfig(timeout_s=5.0, retry=RetryPolicy(attempts=2)))
            async with impatient as client:
                await client.wait_ready()
                conv = ConversationRef(f"unreplicated-{uuid.uuid4().hex}")
                lease = await client.acquire_lease(conv, ttl_ms=30_000)
                redis_set.servers[1].kill()  # the only replica
                turn = dict(lease_token=lease, expected_version=0, publish_id="p-1",
                            messages=[{"role": "user", "content": "hi"}], token_ids=[1, 2], committed_tokens=2,
                            tokens_sha256=tokens_digest([1, 2]))
                with pytest.raises(Unavailable, match="0 of 1 replicas"):
                    await client.publish_turn(conv, **turn)
                # Not acknowledged, yet on the primary: a failover now could lose it, nothing else.
                assert redis_set.primary.client().hget(ConversationKeys.of(conv).head, "version") == b"1"
                redis_set.add_replica()
                head = await client.publish_turn(conv, **turn)  # the same publish: answered, not applied twice
                assert head.version == 1
                assert [t.publish_id for t in (await client.read_ledger(conv)).turns] == ["p-1"]
        finally:
            service.close()


@pytest.mark.parametrize("args, message", [
    (["--redis-url", "redis://127.0.0.1:1/0", "--redis-sentinels", "127.0.0.1:26379"], "not several"),
    (["--redis-cluster", "127.0.0.1:7000", "--redis-sentinels", "127.0.0.1:26379"], "not several"),
    (["--redis-sentinels", "127.0.0.1"], "host:port"),
    (["--redis-cluster", "127.0.0.1:7000,node-b"], "host:port"),
    (["--publish-wait-replicas", "-1"], "publish_wait_replicas"),
], ids=["url-and-sentinels", "cluster-and-sentinels", "sentinel-without-port", "cluster-node-without-port",
        "negative-replicas"])
def test_bad_redis_settings_refuse_to_start(tmp_path, args, message):
    child = CacheServiceChild(["--port", "0", "--data-dir", str(tmp_path), *args], root=SERVICE_ROOT)
    try:
        with pytest.raises(ServiceDidNotStart, match=message):
            child.start(30)
        assert child.proc.wait(10) == 2
    finally:
        child.stop()
