"""Prefix checkpoints in the state tier, through the service: a put is read back byte-exact and
named in the prefix index under TIER_HOLDER; chunks are shared within a scope, never across;
the byte bound evicts the least recently used (and withdraws its name), the TTL expires them;
conversation entries are untouched."""

import asyncio
import hashlib
import os
import uuid

import grpc
import pytest
from cs_helpers import History, ServiceProcess, commit_turn, fast_client

from cache_service.client import NotFound, ResourceExhausted
from proto import cache_pb2 as pb
from proto.contract import TIER_HOLDER, ConversationRef, prefix_scope_tag

pytestmark = pytest.mark.timeout(90)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
KIB = 1 << 10


def new_scope() -> str:
    return f"scope-{uuid.uuid4().hex}"


def new_name() -> str:
    return uuid.uuid4().hex  # 32 lowercase hex, as message_prefix_digests makes them


async def tier_holds(client, scope: str, name: str) -> int | None:
    """The tokens the prefix index says the tier holds of `name`, None if it names no tier copy."""
    match = await client.find_prefix([name], scope=scope)
    return match.tier[1] if match and match.tier else None


async def test_a_put_reads_back_byte_exact_and_the_index_names_the_tier(client):
    scope, name = new_scope(), new_name()
    data = [os.urandom(64 * KIB), os.urandom(3 * KIB + 7)]
    with pytest.raises(NotFound, match="no prefix state"):
        await client.get_prefix_state(scope, name)
    await client.announce_prefixes("replica-a", [(name, 100)], scope=scope)
    reply = await client.put_prefix_state(scope, name, 120, data)
    assert (reply.total_bytes, reply.chunks_sent, reply.chunks_reused) == (len(b"".join(data)), 2, 0)
    assert await client.get_prefix_state(scope, name) == b"".join(data)
    match = await client.find_prefix([name], scope=scope)
    # the tier is no replica: named apart, by the name it holds (the router prices importing it)
    assert match.holders == (("replica-a", 100),) and match.tier == (name, 120)
    with pytest.raises(NotFound):  # the same name under no scope is another prefix
        await client.get_prefix_state(None, name)


async def test_a_scope_stores_shared_chunks_once_and_another_scope_shares_nothing(client):
    scope, other = new_scope(), new_scope()
    first, second = new_name(), new_name()
    system = [os.urandom(32 * KIB) for _ in range(3)]  # a shared system prompt's blocks
    before = await client.stats()
    await client.put_prefix_state(scope, first, 300, [*system, b"user one"])
    reply = await client.put_prefix_state(scope, second, 310, [*system, b"user two"])
    assert (reply.chunks_sent, reply.chunks_reused) == (1, 3)
    stats = await client.stats()
    assert stats.tier_prefix_entries == before.tier_prefix_entries + 2
    assert stats.tier_prefix_bytes == before.tier_prefix_bytes + 3 * 32 * KIB + 16  # `system` once
    assert stats.tier_entries == before.tier_entries  # conversations' entries: none added

    reply = await client.put_prefix_state(other, first, 300, [*system, b"user one"])
    assert (reply.chunks_sent, reply.chunks_reused) == (4, 0)  # the other scope's copies are not its
    with pytest.raises(NotFound):
        await client.get_prefix_state(other, second)
    assert await tier_holds(client, other, second) is None
    assert await client.get_prefix_state(scope, second) == b"".join([*system, b"user two"])


async def test_missing_chunks_answers_within_the_scope_only(client, stub):
    scope, other = new_scope(), new_scope()
    chunk = os.urandom(1000)
    await client.put_prefix_state(scope, new_name(), 10, chunk)
    digest = hashlib.sha256(chunk).digest()
    ask = lambda s: stub.MissingChunks(pb.MissingChunksRequest(  # noqa: E731
        prefix=pb.PrefixStateKey(scope=prefix_scope_tag(s), name=new_name()), digests=[digest]))
    assert list((await ask(scope)).digests) == []
    assert list((await ask(other)).digests) == [digest]


async def test_conversation_entries_are_untouched(client, conv):
    history = History()
    await commit_turn(client, conv, history, [1, 2, 3], "hello")
    head_state = os.urandom(10 * KIB)
    await client.put_state(conv, 1, head_state)
    scope, name = new_scope(), new_name()
    # The same bytes as a prefix: stored apart (its own namespace), read apart.
    reply = await client.put_prefix_state(scope, name, 3, head_state)
    assert reply.chunks_sent == 1 and not reply.HasField("head")
    assert (await client.get_head(conv)).tier_version == 1
    assert await client.get_state(conv) == (1, head_state)
    await client.delete_conversation(conv)
    assert await client.get_prefix_state(scope, name) == head_state


# -- bad input ----------------------------------------------------------------------------------

NAME = "0123456789abcdef0123456789abcdef"
PREFIX = pb.PrefixStateKey(name=NAME, tokens=5)
CONV = pb.ConversationKey(conversation_id="c-1")
CHUNK = pb.ChunkRef(digest=b"\1" * 32, size=3)


async def put(stub, manifest: pb.StateManifest):
    async def stream():
        yield pb.PutStateRequest(manifest=manifest)
    return await stub.PutState(stream())


async def get(stub, request: pb.GetStateRequest):
    return [reply async for reply in stub.GetState(request)]


@pytest.mark.parametrize("call, fragment", [
    (lambda s: put(s, pb.StateManifest(prefix=PREFIX, key=CONV, chunks=[CHUNK])), "conversation fields"),
    (lambda s: put(s, pb.StateManifest(prefix=PREFIX, version=1, chunks=[CHUNK])), "conversation fields"),
    (lambda s: put(s, pb.StateManifest(prefix=PREFIX, incarnation="0" * 16, chunks=[CHUNK])), "conversation"),
    (lambda s: put(s, pb.StateManifest(prefix=PREFIX, lease_token=3, chunks=[CHUNK])), "conversation fields"),
    (lambda s: put(s, pb.StateManifest(prefix=pb.PrefixStateKey(name=NAME), chunks=[CHUNK])),
     "manifest.prefix.tokens must be"),
    (lambda s: put(s, pb.StateManifest(prefix=pb.PrefixStateKey(name=NAME[:31], tokens=5), chunks=[CHUNK])),
     "manifest.prefix.name must be a prefix name"),
    (lambda s: put(s, pb.StateManifest(prefix=pb.PrefixStateKey(scope="tenant", name=NAME, tokens=5),
                                       chunks=[CHUNK])), "manifest.prefix.scope must be"),
    (lambda s: put(s, pb.StateManifest(prefix=PREFIX)), "manifest.chunks must not be empty"),
    (lambda s: get(s, pb.GetStateRequest(prefix=PREFIX, key=CONV)), "conversation fields"),
    (lambda s: get(s, pb.GetStateRequest(prefix=PREFIX, version=2)), "conversation fields"),
    (lambda s: get(s, pb.GetStateRequest(prefix=pb.PrefixStateKey(name=NAME.upper()))), "prefix.name must be"),
    (lambda s: s.MissingChunks(pb.MissingChunksRequest(prefix=PREFIX, key=CONV)), "conversation fields"),
    (lambda s: s.MissingChunks(pb.MissingChunksRequest(prefix=pb.PrefixStateKey(name="x"))), "prefix.name"),
    (lambda s: s.AnnouncePrefixes(pb.AnnouncePrefixesRequest(
        replica=TIER_HOLDER, entries=[pb.PrefixEntry(name=NAME, tokens=5)])), "names the state tier"),
    (lambda s: s.ForgetPrefixes(pb.ForgetPrefixesRequest(replica=TIER_HOLDER, names=[NAME])), "names the state tier"),
])
async def test_bad_input_is_refused(stub, client, call, fragment):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(stub)
    assert info.value.code() == INVALID
    assert fragment in info.value.details()
    assert await client.find_prefix([NAME]) is None  # nothing announced


# -- bounds: services of their own, a small prefix budget or a short TTL ---------------------------

PREFIX_BUDGET = 256 * KIB
PREFIX_TTL_S = 3.0  # the checks within a TTL keep over a second of margin on a loaded machine
SWEEP_S = 0.2


def small_service(redis_server, data_dir, **env: str) -> ServiceProcess:
    proc = ServiceProcess(data_dir=data_dir, redis_url=redis_server.url,
                          extra_env={"CACHE_TIER_SWEEP_INTERVAL_S": str(SWEEP_S), **env})
    proc.start()
    return proc


@pytest.fixture(scope="module")
def bounded(redis_server, tmp_path_factory):
    proc = small_service(redis_server, tmp_path_factory.mktemp("bounded"), CACHE_PREFIX_TIER_BYTES=str(PREFIX_BUDGET))
    yield proc
    try:
        assert proc.terminate() == 0
    finally:
        proc.close()


async def test_the_byte_bound_evicts_the_least_recently_used_and_withdraws_its_name(bounded):
    scope, (n1, n2, n3) = new_scope(), (new_name(), new_name(), new_name())
    shared, a, b, c = (os.urandom(64 * KIB) for _ in range(4))
    async with fast_client(bounded.target) as cache:
        await cache.put_prefix_state(scope, n1, 10, [shared, a])
        assert (await cache.put_prefix_state(scope, n2, 20, [shared, b])).chunks_reused == 1
        assert await cache.get_prefix_state(scope, n1) == shared + a  # n2 is now the least recently used
        tail = os.urandom(36 * KIB)
        await cache.put_prefix_state(scope, n3, 30, [c, tail])  # 292 KiB > 256 KiB
        with pytest.raises(NotFound):
            await cache.get_prefix_state(scope, n2)
        assert await tier_holds(cache, scope, n2) is None  # withdrawn, long before its TTL
        assert await cache.get_prefix_state(scope, n1) == shared + a  # `shared`, which n2 used, stays
        assert [await tier_holds(cache, scope, n) for n in (n1, n3)] == [10, 30]
        assert (await cache.stats()).tier_prefix_bytes == 3 * 64 * KIB + 36 * KIB
        with pytest.raises(ResourceExhausted):  # alone over the bound: refused, nothing evicted
            await cache.put_prefix_state(scope, new_name(), 40, os.urandom(PREFIX_BUDGET + 1))
        assert await cache.get_prefix_state(scope, n3) == c + tail


async def swept_within(cache, timeout_s: float) -> bool:
    """Whether the service's stats show no prefix entry within `timeout_s` (its sweeper runs every
    SWEEP_S, but a sweep on a loaded machine may come late)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await cache.stats()
        if (stats.tier_prefix_entries, stats.tier_prefix_bytes) == (0, 0):
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(SWEEP_S)


async def test_an_entry_expires_a_ttl_after_its_last_use_and_its_name_with_it(redis_server, tmp_path):
    proc = small_service(redis_server, tmp_path, CACHE_PREFIX_TTL_S=str(PREFIX_TTL_S))
    scope, name = new_scope(), new_name()
    try:
        async with fast_client(proc.target) as cache:
            await cache.put_prefix_state(scope, name, 10, b"short-lived")
            await asyncio.sleep(1.6)
            assert await cache.get_prefix_state(scope, name) == b"short-lived"  # its TTL starts over
            await asyncio.sleep(1.8)  # 3.4 s after the put: past its first TTL, within the second
            assert await cache.get_prefix_state(scope, name) == b"short-lived"
            assert await tier_holds(cache, scope, name) == 10
            await asyncio.sleep(PREFIX_TTL_S)  # past the TTL: the next sweep takes it, unasked
            assert await swept_within(cache, 10.0)
            assert await tier_holds(cache, scope, name) is None
            with pytest.raises(NotFound):
                await cache.get_prefix_state(scope, name)
    finally:
        assert proc.terminate() == 0
        proc.close()


async def test_sweeps_leave_conversations_and_live_prefixes_alone(bounded):
    scope, name = new_scope(), new_name()
    async with fast_client(bounded.target) as cache:
        conv = ConversationRef(f"c-{uuid.uuid4().hex}")
        await commit_turn(cache, conv, History(), [1], "hi")
        await cache.put_state(conv, 1, b"head state")
        await cache.put_prefix_state(scope, name, 1, b"prefix state")
        await asyncio.sleep(0.5)  # two sweeps
        assert await cache.get_state(conv) == (1, b"head state")
        assert await cache.get_prefix_state(scope, name) == b"prefix state"
