"""Crashes: Redis SIGKILLed and restarted, the cache service SIGKILLed and restarted.

This module runs its own Redis (appendfsync always: the policy that loses nothing
acknowledged) and its own service, since it kills them.
"""

import asyncio
import os
import signal
import time
import uuid

import pytest
from cs_helpers import History, ServiceProcess, commit_turn, fast_client

from cache_service.client import CacheClient, ClientConfig, DeadlineExceeded
from cache_service.config import FsyncPolicy
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from proto.contract import ConversationRef, tokens_digest

# Processes get killed here; a hang must fail fast, not eat the session timeout.
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path_factory.mktemp("redis-crash"),
                                               fsync=FsyncPolicy.ALWAYS))
    server.start()
    yield server
    server.stop()  # also after a failed restart: stop() is a no-op if it is not running


@pytest.fixture(scope="module")
def own_service(own_redis, tmp_path_factory):
    proc = ServiceProcess(data_dir=tmp_path_factory.mktemp("service-crash"), redis_url=own_redis.url)
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
async def own_client(own_service):
    async with fast_client(own_service.target) as c:
        await c.wait_ready()
        yield c


def new_conv() -> ConversationRef:
    return ConversationRef(f"durable-{uuid.uuid4().hex}", salt="s")


async def snapshot(client, convs):
    return {c: await client.read_ledger(c) for c in convs}


async def test_redis_sigkill_and_restart_keeps_every_committed_turn(own_client, own_redis, own_service):
    convs = [new_conv() for _ in range(6)]
    histories = {c: History() for c in convs}

    async def three_turns(c):
        for t in range(3):
            await commit_turn(own_client, c, histories[c], [t * 10 + i for i in range(t + 2)], f"{c.id}/{t}")

    await asyncio.gather(*(three_turns(c) for c in convs))
    before = await snapshot(own_client, convs)
    last = convs[0]
    lease = await own_client.acquire_lease(last, ttl_ms=60_000)

    own_redis.kill()
    # A publish issued while Redis is down: the service answers UNAVAILABLE, the client
    # backs off and retries until Redis is back.
    tokens = histories[last].tokens + [99]
    publish = asyncio.create_task(own_client.publish_turn(
        last, lease_token=lease.token, expected_version=3, messages=[{"role": "user", "content": "late"}],
        token_ids=[99], committed_tokens=len(tokens), tokens_sha256=tokens_digest(tokens)))
    await asyncio.to_thread(own_service.wait_event,
                            lambda e: e.get("rpc") == "PublishTurn" and e.get("code") == "UNAVAILABLE")
    assert not publish.done()
    own_redis.start()  # same port, same data directory: the AOF is replayed
    head = await publish
    assert head.version == 4

    after = await snapshot(own_client, convs)
    for c in convs:
        expected_turns = list(before[c].turns) + ([] if c != last else list(after[c].turns[3:]))
        assert list(after[c].turns) == expected_turns
        assert after[c].head.tokens_sha256 == tokens_digest(
            histories[c].tokens + ([99] if c == last else []))
    assert [t.token_ids[-1] for t in after[last].turns] == [1, 12, 23, 99]


async def test_service_sigkill_and_restart_loses_no_turn(own_client, own_service):
    conv = new_conv()
    history = History()
    await commit_turn(own_client, conv, history, [1, 2, 3], "one")
    await commit_turn(own_client, conv, history, [4, 5], "two")
    await own_client.put_state(conv, 2, b"exported state" * 1000)

    own_service.kill()
    # The next turn starts while the service is dead; the same client rides it out.
    third = asyncio.create_task(commit_turn(own_client, conv, history, [6], "three"))
    await asyncio.to_thread(own_service.start)  # same port
    await third

    ledger = await own_client.read_ledger(conv)
    assert [list(t.token_ids) for t in ledger.turns] == [[1, 2, 3], [4, 5], [6]]
    assert ledger.head.version == 3 and ledger.head.committed_tokens == 6
    # The tier lived in the dead process: the head says so rather than pointing at nothing.
    assert ledger.head.tier_version == 0


async def test_deadline_bounds_a_call_when_redis_hangs(own_client, own_redis, own_service):
    conv = new_conv()
    await commit_turn(own_client, conv, History(), [1], "one")
    impatient = CacheClient(own_service.target, ClientConfig(timeout_s=0.3))
    os.kill(own_redis.pid, signal.SIGSTOP)  # Redis hangs: connections open, no answers
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await impatient.get_head(conv)
        assert time.monotonic() - started < 3.0  # not the 5 s Redis socket timeout
    finally:
        os.kill(own_redis.pid, signal.SIGCONT)
    assert (await impatient.get_head(conv)).version == 1
    await impatient.close()


async def test_a_put_cut_by_a_service_crash_is_retried(own_client, own_service):
    conv = new_conv()
    await commit_turn(own_client, conv, History(), [1], "one")
    data = os.urandom(48 << 20)
    put = asyncio.create_task(own_client.put_state(conv, 1, data))
    async with fast_client(own_service.target) as observer:
        while (await observer.stats()).tier_staged_bytes == 0:
            assert not put.done(), "the put finished before the crash could cut it"
            await asyncio.sleep(0.005)  # polled: the service exposes staging only in its stats
    own_service.kill()
    await asyncio.to_thread(own_service.start)  # same port; the client re-sends the whole put
    reply = await put
    assert reply.head.tier_version == 1
    assert await own_client.get_state(conv) == (1, data)
