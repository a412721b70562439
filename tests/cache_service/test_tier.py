"""The state tier through the service: round trips, incremental puts, spill, corruption."""

import os
import random

import pytest
from cs_helpers import TIER_BUDGET, History, commit_turn

from cache_service.client import DataLoss, NotFound, VersionConflict
from cache_service.tier import SPILL_SUBDIR


async def conversation_at_version(client, conv, versions=1):
    history = History()
    for i in range(versions):
        await commit_turn(client, conv, history, [i + 1], f"t{i}")
    return history


async def test_64_mib_head_round_trips_byte_exact_through_disk(client, conv):
    await conversation_at_version(client, conv)
    data = random.Random(1).randbytes(64 << 20)
    reply = await client.put_state(conv, 1, data)
    assert reply.total_bytes == len(data) and reply.chunks_sent == 64
    assert reply.head.tier_version == 1
    stats = await client.stats()
    # 64 MiB cannot fit a 16 MiB budget: most of it went to disk, memory stayed bounded.
    assert stats.tier_memory_bytes <= TIER_BUDGET
    assert stats.tier_disk_bytes >= len(data) - TIER_BUDGET
    version, back = await client.get_state(conv)
    assert version == 1 and back == data
    assert (await client.stats()).tier_disk_reads > stats.tier_disk_reads
    assert (await client.get_head(conv)).tier_version == 1
    await client.delete_conversation(conv)  # free the disk for the other tests
    with pytest.raises(NotFound):
        await client.get_state(conv)


async def test_incremental_put_sends_only_new_chunks_and_supersedes(client, conv):
    await conversation_at_version(client, conv, versions=1)
    chunks = [os.urandom(64 << 10) for _ in range(8)]
    first = await client.put_state(conv, 1, chunks)
    assert (first.chunks_sent, first.chunks_reused) == (8, 0)

    await commit_turn(client, conv, History(tokens=[1], version=1), [2], "t1")
    # Version 2: the full blocks are unchanged, the tail changed, one block was added.
    chunks2 = chunks[:7] + [os.urandom(64 << 10), os.urandom(1000)]
    second = await client.put_state(conv, 2, chunks2)
    assert (second.chunks_sent, second.chunks_reused) == (2, 7)
    version, back = await client.get_state(conv)
    assert version == 2 and back == b"".join(chunks2)
    with pytest.raises(NotFound):  # superseded
        await client.get_state(conv, version=1)


async def test_a_chosen_chunk_over_the_service_limit_is_cut_and_reassembled(client, conv):
    """A worker names its chunks (one per KV block, one for the Mamba state); a state chunk of
    a real model is larger than the service's per-chunk limit and was refused outright."""
    await conversation_at_version(client, conv)
    blocks = [os.urandom(32 << 10) for _ in range(3)]
    state = os.urandom((4 << 20) + 12345)  # over the service's 4 MiB chunk limit
    reply = await client.put_state(conv, 1, [*blocks, state])
    assert reply.head.tier_version == 1
    version, back = await client.get_state(conv)
    assert version == 1 and back == b"".join([*blocks, state])


async def test_put_must_match_the_committed_head_version(client, conv):
    await conversation_at_version(client, conv, versions=2)
    before = await client.stats()
    with pytest.raises(VersionConflict):
        await client.put_state(conv, 1, b"old state")
    with pytest.raises(VersionConflict):
        await client.put_state(conv, 3, b"future state")
    assert (await client.stats()).tier_entries == before.tier_entries
    with pytest.raises(NotFound):
        await client.get_state(conv)


async def test_corrupted_chunk_on_disk_is_detected(client, conv, service):
    await conversation_at_version(client, conv)
    data = os.urandom(TIER_BUDGET + (4 << 20))  # larger than the budget: its head spills
    await client.put_state(conv, 1, data)
    spilled = service.data_dir / "tier" / SPILL_SUBDIR / conv.key
    victim = sorted(spilled.iterdir())[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))

    failures = (await client.stats()).tier_checksum_failures
    with pytest.raises(DataLoss):
        await client.get_state(conv)
    assert (await client.stats()).tier_checksum_failures == failures + 1
    # The entry is dropped, so the head no longer claims a tier copy (recovery recomputes).
    assert (await client.get_head(conv)).tier_version == 0
    with pytest.raises(NotFound):
        await client.get_state(conv)


async def test_delete_drops_the_tier_entry(client, conv):
    await conversation_at_version(client, conv)
    data = os.urandom(100_000)
    await client.put_state(conv, 1, data)
    entries = (await client.stats()).tier_entries
    await client.delete_conversation(conv)
    assert (await client.stats()).tier_entries == entries - 1
    with pytest.raises(NotFound):
        await client.get_state(conv)
    # Its chunks are gone too: a fresh put of the same bytes has to send them again.
    await conversation_at_version(client, conv)
    again = await client.put_state(conv, 1, data)
    assert (again.chunks_sent, again.chunks_reused) == (1, 0)


async def test_migration_export_transfer_import(client, conv):
    """Scale-in: the owner exports its head, the router moves ownership, the new
    owner imports exactly the exported bytes; a stale export cannot overwrite it."""
    history = await conversation_at_version(client, conv, versions=2)
    exported = os.urandom(3 << 20) + b"tail"
    await client.put_state(conv, history.version, exported)

    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    head = await client.get_head(conv)
    assert (head.owner_replica, head.tier_version) == ("replica-0", 2)
    moved = await client.transfer_ownership(conv, lease_token=lease.token, expected_version=head.version,
                                            new_owner="replica-1")
    assert moved.owner_replica == "replica-1" and moved.tier_version == 2
    version, imported = await client.get_state(conv, version=moved.tier_version)
    assert version == 2 and imported == exported

    # The new owner commits turn 3; an export of version 2 arriving late is refused.
    await client.release_lease(conv, lease.token)
    await commit_turn(client, conv, history, [9], "on the new replica", owner="replica-1")
    with pytest.raises(VersionConflict):
        await client.put_state(conv, 2, b"late export of version 2")
    head = await client.get_head(conv)
    assert (head.version, head.owner_replica, head.tier_version) == (3, "replica-1", 2)
