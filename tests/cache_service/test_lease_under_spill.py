"""Leases renew on time while the state tier spills tens of MiB to a slow disk.

The tier's lock is held while a commit writes its spill. The event loop once took that lock
for every head reply (`tier_version`), so a GetHead arriving mid-spill stopped the whole loop,
every RenewLease with it, until the spill was written: a 1.5 s lease could lapse.

The slow disk: the first chunk's spill file is a named pipe, so the spill's write blocks (its
first 64 KiB fill the pipe) until the test reads it, for as long as the test chooses.
"""

import asyncio
import hashlib
import os
import random
import uuid

from cs_helpers import TIER_BUDGET, History, commit_turn

from cache_service.tier import SPILL_SUBDIR
from proto.contract import ConversationRef

TTL_MS = 1500
PERIOD_S = TTL_MS / 1000 / 4  # how often a keeper renews, and how long each renewal may take


async def test_renewals_answer_within_their_period_while_the_tier_spills(client, service, conv):
    await commit_turn(client, conv, History(), [1], "a head worth exporting")
    data = random.Random(3).randbytes(3 * TIER_BUDGET)  # 48 MiB: 32 and more go to disk at the commit
    spill_dir = service.data_dir / "tier" / SPILL_SUBDIR / conv.key
    spill_dir.mkdir(parents=True, exist_ok=True)
    first = spill_dir / f"{hashlib.sha256(data[:1 << 20]).hexdigest()}.tmp"
    os.mkfifo(first)
    pipe = os.open(first, os.O_RDONLY | os.O_NONBLOCK)  # the spill's open then does not block: its write does
    loop = asyncio.get_running_loop()
    spilling = asyncio.Event()
    loop.add_reader(pipe, spilling.set)
    other = ConversationRef(f"conv-{uuid.uuid4().hex}", salt=conv.salt)
    lease = await client.acquire_lease(other, ttl_ms=TTL_MS)
    put = asyncio.create_task(client.put_state(conv, 1, data))
    latencies: list[float] = []

    async def heads() -> None:  # what workers ask all the time; each reply reads the tier's version
        while not put.done():
            await client.get_head(conv)

    async def renewals() -> None:  # a keeper's schedule: one attempt per period, bounded by it
        while not put.done():
            sent = loop.time()
            await client.renew_lease(other, lease, TTL_MS, timeout_s=PERIOD_S)  # DeadlineExceeded if late
            latencies.append(loop.time() - sent)
            await asyncio.sleep(max(0.0, PERIOD_S - (loop.time() - sent)))

    async def slow_disk() -> None:
        try:
            await asyncio.wait_for(spilling.wait(), 60)
            before = len(latencies)
            await asyncio.sleep(2 * TTL_MS / 1000)  # the spill stays stuck for two TTLs
            assert len(latencies) - before >= 4, "no renewal was answered while the spill was stuck"
        finally:
            loop.remove_reader(pipe)
            os.set_blocking(pipe, True)
            await asyncio.to_thread(lambda: [None for _ in iter(lambda: os.read(pipe, 1 << 20), b"")])
            os.close(pipe)

    await asyncio.gather(put, heads(), renewals(), slow_disk())
    assert max(latencies) < PERIOD_S, latencies
    await client.release_lease(other, lease)
    await client.delete_conversation(conv)  # free the disk for the other tests (the pipe goes too)
