"""Retention: a conversation's keys expire a configured time after its last turn, its tier entry
goes with it, and a full Redis refuses writes with STORAGE_FULL while reads go on.

Real redis-servers and real service processes: the session's service keeps the 30-day default,
the others here are started with a short TTL, with none, and on an embedded Redis of a few MiB.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis
from cs_helpers import History, ServiceProcess, commit_turn, fast_client

from cache_service.client import NotFound, StorageFull
from cache_service.keys import ConversationKeys
from proto.contract import ConversationRef, tokens_digest

SHORT_TTL_S = 3.0
DEFAULT_TTL_MS = 30 * 86400 * 1000
LEASE_MS = 10_000  # commit_turn's lease


def _service(tmp_path_factory, name: str, redis_url: str | None, **env: str) -> ServiceProcess:
    proc = ServiceProcess(data_dir=tmp_path_factory.mktemp(name), redis_url=redis_url, extra_env=env)
    proc.start()
    return proc


@pytest.fixture(scope="module")
def short_ttl_service(redis_server, tmp_path_factory):
    proc = _service(tmp_path_factory, "short-ttl", redis_server.url, CACHE_CONVERSATION_TTL_S=str(SHORT_TTL_S),
                    CACHE_TIER_SWEEP_INTERVAL_S="0.2")
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def no_ttl_service(redis_server, tmp_path_factory):
    proc = _service(tmp_path_factory, "no-ttl", redis_server.url, CACHE_CONVERSATION_TTL_S="0")
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def conversation_keys(conv: ConversationRef) -> dict[str, str]:
    keys = ConversationKeys.of(conv)
    return {"head": keys.head, "ledger": keys.ledger, "marks": keys.marks, "fence": keys.fence}


def stored_keys(redis_client, conv: ConversationRef) -> list[bytes]:
    return sorted(redis_client.scan_iter(match=f"hs:v1:conv:{{{ConversationKeys.of(conv).conv_hash}}}:*"))


def new_conv() -> ConversationRef:
    return ConversationRef(f"conv-{uuid.uuid4().hex}", salt="retention")


async def test_every_key_of_a_conversation_expires_30_days_after_its_turn(client, conv, redis_client):
    await commit_turn(client, conv, History(), [1, 2, 3], "hello")
    ttls = {kind: redis_client.pttl(key) for kind, key in conversation_keys(conv).items()}
    for kind in ("head", "ledger", "marks"):
        assert DEFAULT_TTL_MS - 60_000 < ttls[kind] <= DEFAULT_TTL_MS, (kind, ttls)
    assert 0 < ttls["fence"] <= LEASE_MS + 3_600_000  # its own retention, shorter than the conversation's
    assert {k.decode().rsplit(":", 1)[1] for k in stored_keys(redis_client, conv)} == {"head", "ledger", "marks",
                                                                                      "fence"}


async def test_a_fork_and_a_rewind_keep_the_ttl(client, conv, redis_client):
    history = History()
    await commit_turn(client, conv, history, [1], "one")
    await commit_turn(client, conv, history, [2], "two")
    fork = ConversationRef(f"{conv.id}-fork", salt=conv.salt)
    await client.fork_conversation(conv, fork.id, turn=1)
    for kind in ("head", "ledger", "marks"):
        assert redis_client.pttl(conversation_keys(fork)[kind]) > DEFAULT_TTL_MS - 60_000, kind
    lease = await client.acquire_lease(conv, ttl_ms=LEASE_MS)
    await client.rewind_conversation(conv, lease_token=lease, expected_version=2, turn=0)
    assert redis_client.pttl(conversation_keys(conv)["head"]) > DEFAULT_TTL_MS - 60_000


async def test_an_idle_conversation_expires_whole_and_its_tier_entry_follows(short_ttl_service, redis_client):
    conv = new_conv()
    async with fast_client(short_ttl_service.target) as cache:
        await commit_turn(cache, conv, History(), [1, 2], "soon gone")
        await cache.put_state(conv, 1, b"exported head state")
        assert (await cache.get_head(conv)).tier_version == 1
        assert 0 < redis_client.pttl(conversation_keys(conv)["head"]) <= SHORT_TTL_S * 1000
        # The head, ledger and marks go at the TTL; the fence outlives them by the last lease's TTL
        # (a holder that lost its lease must still be refused), bounded too. Waiting on the fence
        # as well would put the deadline on the fence's expiry itself.
        fence_key = conversation_keys(conv)["fence"].encode()
        assert 0 < redis_client.pttl(fence_key) <= SHORT_TTL_S * 1000 + LEASE_MS
        deadline = time.monotonic() + SHORT_TTL_S + 10
        while [k for k in stored_keys(redis_client, conv) if k != fence_key] or (await cache.stats()).tier_entries:
            assert time.monotonic() < deadline, f"still stored: {stored_keys(redis_client, conv)}"
            await asyncio.sleep(0.2)
        with pytest.raises(NotFound):
            await cache.get_head(conv)
        with pytest.raises(NotFound):
            await cache.read_ledger(conv)
        with pytest.raises(NotFound):
            await cache.get_state(conv)
        # Like a deleted conversation: the same id starts afresh, at version 1.
        assert (await cache.acquire_lease(conv, ttl_ms=LEASE_MS)).head.version == 0


async def test_a_turn_and_a_held_lease_refresh_the_ttl(short_ttl_service, redis_client):
    conv = new_conv()
    head_key = conversation_keys(conv)["head"]
    async with fast_client(short_ttl_service.target) as cache:
        history = History()
        await commit_turn(cache, conv, history, [1], "first")
        await asyncio.sleep(1.5)  # halfway: the refresh below shows by a second and a half
        left = redis_client.pttl(head_key)
        assert left <= SHORT_TTL_S * 1000 - 1500
        await commit_turn(cache, conv, history, [2], "second")
        assert redis_client.pttl(head_key) > left + 500
        # A lease extends the conversation past its own TTL: nothing expires under a turn.
        lease = await cache.acquire_lease(conv, ttl_ms=LEASE_MS)
        assert redis_client.pttl(head_key) > SHORT_TTL_S * 1000 + LEASE_MS - 2000
        await cache.renew_lease(conv, lease, LEASE_MS)
        assert redis_client.pttl(conversation_keys(conv)["ledger"]) > SHORT_TTL_S * 1000 + LEASE_MS - 2000
        assert redis_client.pttl(ConversationKeys.of(conv).lease) <= LEASE_MS  # the lease keeps its own TTL


async def test_a_ttl_of_zero_stores_for_ever(short_ttl_service, no_ttl_service, redis_client):
    conv = new_conv()
    history = History()
    async with fast_client(short_ttl_service.target) as short, fast_client(no_ttl_service.target) as never:
        await commit_turn(short, conv, history, [1], "with a ttl")
        assert redis_client.pttl(conversation_keys(conv)["head"]) > 0
        await commit_turn(never, conv, history, [2], "kept for ever")  # the configuration changed
    for kind in ("head", "ledger", "marks"):
        assert redis_client.pttl(conversation_keys(conv)[kind]) == -1, kind


# -- a full Redis --------------------------------------------------------------------------------

FULL_MAXMEMORY = 3 << 20
BIG_TEXT = "x" * (256 << 10)


@pytest.fixture(scope="module")
def full_service(tmp_path_factory):
    """On its own embedded Redis of 3 MiB (the service's --redis-maxmemory)."""
    proc = _service(tmp_path_factory, "full", None, CACHE_REDIS_MAXMEMORY=str(FULL_MAXMEMORY))
    yield proc
    proc.close()


async def _publish_big_turn(cache, conv: ConversationRef, history: History, lease) -> None:
    tokens = history.tokens + [7]
    await cache.publish_turn(conv, lease_token=lease, expected_version=history.version,
                             messages=[{"role": "user", "content": BIG_TEXT}], token_ids=[7],
                             committed_tokens=len(tokens), tokens_sha256=tokens_digest(tokens), release_lease=False)
    history.tokens, history.version = tokens, history.version + 1


async def test_a_full_redis_refuses_writes_with_storage_full_and_reads_go_on(full_service):
    port = full_service.event("embedded_redis_started")["port"]
    with redis.Redis(port=port) as raw:  # the service configured its Redis so
        assert raw.config_get("maxmemory") == {"maxmemory": str(FULL_MAXMEMORY)}
        assert raw.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    async with fast_client(full_service.target) as cache:
        kept = new_conv()
        await commit_turn(cache, kept, History(), [1], "stored before the store filled up")
        held = await cache.acquire_lease(kept, ttl_ms=LEASE_MS, holder="long-turn")
        filler, history = new_conv(), History()
        lease = await cache.acquire_lease(filler, ttl_ms=LEASE_MS)
        with pytest.raises(StorageFull) as refused:
            for _ in range(4 * FULL_MAXMEMORY // len(BIG_TEXT)):
                await _publish_big_turn(cache, filler, history, lease)
                await cache.renew_lease(filler, lease, LEASE_MS)
        assert "full" in refused.value.message
        assert history.version >= 2  # it did fill up on the way
        with pytest.raises(StorageFull):  # refused again, as long as it does not fit
            await _publish_big_turn(cache, filler, history, lease)
        # The refused writes changed nothing: the head and its ledger are those of the last success.
        filled = await cache.read_ledger(filler)
        assert (filled.head.version, len(filled.turns)) == (history.version, history.version)
        # Reads go on; so do renewals (a lease must never be lost to a full store) and deletes.
        assert (await cache.get_head(kept)).turn == 1
        assert (await cache.read_ledger(kept)).turns[0].messages[0].content == "stored before the store filled up"
        await cache.renew_lease(kept, held, LEASE_MS)
        await cache.release_lease(kept, held)
        assert await cache.delete_conversation(filler)
