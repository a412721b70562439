"""The state tier under abuse: unfinished and idle puts, inconsistent manifests, a disk
that refuses writes, puts that outlive their conversation, spill directories left over."""

import asyncio
import hashlib
import os
import subprocess
import time

import grpc
import pytest
from tests.cache_service.cs_helpers import STRICT_STAGED_BYTES, STRICT_TIER_BUDGET, STRICT_TOKEN
from cs_helpers import TIER_BUDGET, History, commit_turn

from cache_service.client import InvalidArgument, LeaseLost, NotFound, ResourceExhausted, key_message
from cache_service.tier import SPILL_SUBDIR
from cache_service.wire import bearer
from proto.contract import ConversationRef
from proto import cache_pb2 as pb
from proto import cache_pb2_grpc

AUTH = bearer(STRICT_TOKEN)


@pytest.fixture(scope="module")
async def strict_stub(strict_service):
    channel = grpc.aio.insecure_channel(strict_service.target, options=[
        ("grpc.max_send_message_length", 64 << 20)])
    yield cache_pb2_grpc.CacheServiceStub(channel)
    await channel.close()


def manifest(conv, chunks, *, version=1, incarnation="0" * 16, sizes=None):
    sizes = sizes or [len(c) for c in chunks]
    return pb.PutStateRequest(manifest=pb.StateManifest(
        key=key_message(conv), version=version, incarnation=incarnation,
        chunks=[pb.ChunkRef(digest=hashlib.sha256(c).digest(), size=s) for c, s in zip(chunks, sizes)]))


def chunk(data):
    return pb.PutStateRequest(chunk=pb.Chunk(digest=hashlib.sha256(data).digest(), data=data))


async def until(predicate, timeout_s=10.0):
    """Wait for a condition the service exposes only through polling (its stats)."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def test_staged_bytes_are_bounded_and_idle_puts_are_cut(strict_client, strict_stub):
    never = asyncio.Event()
    data = os.urandom(3 << 20)

    def hanging_put(name):
        async def requests():
            yield manifest(ConversationRef(name), [data, b"never sent"])
            yield chunk(data)
            await never.wait()  # a client that stops sending mid-put

        async def call():
            return await strict_stub.PutState(requests(), metadata=AUTH)
        return asyncio.create_task(call())

    async def staged_is(n):
        return (await strict_client.stats()).tier_staged_bytes == n

    hanging = []
    for i in range(STRICT_STAGED_BYTES // len(data)):
        hanging.append(hanging_put(f"hang-{i}"))
        await until(lambda: staged_is(len(data) * len(hanging)))
    # One more put would take the staged bytes over the limit: refused, not held.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(hanging_put("one-too-many"), 10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata())["hs-reason"] == "resource_exhausted"
    # The silent streams are cut by the idle timeout and their bytes released.
    for task in hanging:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(task, 10)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await staged_is(0)
    # One stream cannot announce more than the staging limit either.
    huge = pb.PutStateRequest(manifest=pb.StateManifest(
        key=key_message(ConversationRef("huge")), version=1, incarnation="0" * 16,
        chunks=[pb.ChunkRef(digest=i.to_bytes(32, "big"), size=4 << 20) for i in range(3)]))

    async def one(message):
        yield message
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await strict_stub.PutState(one(huge), metadata=AUTH)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    never.set()


async def test_chunk_sizes_must_agree_with_the_tier(client, stub, conv):
    history = History()
    await commit_turn(client, conv, history, [1], "t1")
    good = os.urandom(1000)
    await client.put_state(conv, 1, [good])
    await commit_turn(client, conv, history, [2], "t2")
    inc = (await client.get_head(conv)).incarnation

    async def only(message):
        yield message
    bad_manifests = [
        manifest(conv, [good, good], version=2, incarnation=inc, sizes=[1000, 999]),  # one digest, two sizes
        manifest(conv, [good], version=2, incarnation=inc, sizes=[999]),  # a held chunk, wrong size
    ]
    for bad in bad_manifests:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.PutState(only(bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        # The good entry is kept, intact.
        assert await client.get_state(conv) == (1, good)
        assert (await client.get_head(conv)).tier_version == 1


async def test_a_disk_error_while_spilling_installs_nothing(strict_client, strict_service):
    conv = ConversationRef("spill-fails")
    await commit_turn(strict_client, conv, History(), [1], "t")
    data = os.urandom(STRICT_TIER_BUDGET + (2 << 20))  # must spill
    before = await strict_client.stats()
    spill_dir = strict_service.data_dir / "tier" / SPILL_SUBDIR
    pid = str(strict_service.proc.pid)
    # Soft limit only (the hard one stays), so it can be lifted again: writes fail, EFBIG.
    subprocess.run(["prlimit", "--pid", pid, "--fsize=65536:unlimited"], check=True)
    try:
        with pytest.raises(ResourceExhausted) as info:
            await strict_client.put_state(conv, 1, data)
        assert "spill" in str(info.value)
    finally:
        subprocess.run(["prlimit", "--pid", pid, "--fsize=unlimited:unlimited"], check=True)
    after = await strict_client.stats()
    assert (after.tier_entries, after.tier_memory_bytes, after.tier_disk_bytes) == \
        (before.tier_entries, before.tier_memory_bytes, before.tier_disk_bytes)
    assert not list(spill_dir.rglob("*.tmp"))
    assert (await strict_client.get_head(conv)).tier_version == 0
    with pytest.raises(NotFound):
        await strict_client.get_state(conv)
    # With the disk back, the same put works and reads back.
    await strict_client.put_state(conv, 1, data)
    assert await strict_client.get_state(conv) == (1, data)
    await strict_client.delete_conversation(conv)


async def test_a_put_for_a_deleted_incarnation_is_refused(client, stub, conv):
    await commit_turn(client, conv, History(), [1], "old life")
    old = await client.get_head(conv)
    stale = b"state of the deleted conversation"
    finish = asyncio.Event()

    async def slow_put():
        yield manifest(conv, [stale], incarnation=old.incarnation)
        yield chunk(stale)
        await finish.wait()  # the put is still streaming while the conversation changes
    # Whether its first messages reach the service before or after the delete does
    # not matter: the put names the old life, which is all that gives it away.
    async def call():
        return await stub.PutState(slow_put())
    put = asyncio.create_task(call())
    assert await client.delete_conversation(conv)
    await commit_turn(client, conv, History(), [2], "new life", owner="replica-new")
    new = await client.get_head(conv)
    assert new.version == old.version  # same number, another life
    finish.set()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await put
    assert info.value.code() == grpc.StatusCode.ABORTED
    with pytest.raises(NotFound):
        await client.get_state(conv)
    assert (await client.get_head(conv)).tier_version == 0
    assert new.incarnation != old.incarnation
    # The new life's own export goes through.
    await client.put_state(conv, new, b"new state")
    assert await client.get_state(conv) == (1, b"new state")


async def test_deleting_removes_the_spill_directory(client, conv, service):
    await commit_turn(client, conv, History(), [1], "t")
    await client.put_state(conv, 1, os.urandom(TIER_BUDGET + (2 << 20)))
    spilled = service.data_dir / "tier" / SPILL_SUBDIR / conv.key
    assert any(spilled.iterdir())
    await client.delete_conversation(conv)
    assert not spilled.exists()


async def test_bad_manifest_through_the_client_is_a_typed_error(client, conv):
    await commit_turn(client, conv, History(), [1], "t")
    with pytest.raises(InvalidArgument):
        await client.put_state(conv, 1, [b"x"], incarnation="not-hex")


async def test_a_put_naming_a_lease_is_fenced_by_it(client, conv):
    await commit_turn(client, conv, History(), [1], "t")
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    head = lease.head
    reply = await client.put_state(conv, head, b"exported under the lease", lease=lease)
    assert reply.head.tier_version == 1
    await client.release_lease(conv, lease)
    with pytest.raises(LeaseLost):
        await client.put_state(conv, head, b"exported after the lease was gone", lease=lease)
    other = await client.acquire_lease(ConversationRef(conv.id + "-x", conv.salt), ttl_ms=10_000)
    with pytest.raises(LeaseLost):
        await client.put_state(conv, head, b"under another conversation's lease", lease=other)
    assert await client.get_state(conv) == (1, b"exported under the lease")
