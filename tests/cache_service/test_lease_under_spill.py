"""Leases renew on time while the state tier spills tens of MiB to a slow disk.

The tier's lock is held while a commit writes its spill. The event loop once took that lock
for every head reply (`tier_version`), so a GetHead arriving mid-spill stopped the whole loop,
every RenewLease with it, until the spill was written: a 1.5 s lease lapsed.

The slow disk: the first chunk's spill file is a named pipe, so the spill's write blocks (its
first 64 KiB fill the pipe) until the test reads it, for as long as the test chooses.
"""

import asyncio
import hashlib
import math
import os
import random
import uuid

from cs_helpers import TIER_BUDGET, History, commit_turn

from cache_service.client import DeadlineExceeded
from cache_service.tier import SPILL_SUBDIR
from proto.contract import ConversationRef

TTL_MS = 1500
PERIOD_S = TTL_MS / 1000 / 4  # how often a keeper renews
# A renewal sent at t extends a lease the one before it (sent at t - PERIOD_S) kept until
# t - PERIOD_S + TTL: answered later than that, the lease had lapsed meanwhile.
IN_TIME_S = TTL_MS / 1000 - PERIOD_S


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
    renewed: list[tuple[float, float]] = []  # (sent at, seconds to the answer; inf: past its deadline)
    stuck: list[float] = []  # [from, to] while the spill's write was held

    async def heads() -> None:  # what workers ask all the time; each reply reads the tier's version
        while not put.done():
            await client.get_head(conv)

    async def renewals() -> None:  # a keeper's schedule: one attempt per period
        while not put.done():
            sent = loop.time()
            try:
                await client.renew_lease(other, lease, TTL_MS, timeout_s=IN_TIME_S)
                renewed.append((sent, loop.time() - sent))
            except DeadlineExceeded:
                renewed.append((sent, math.inf))
            await asyncio.sleep(max(0.0, PERIOD_S - (loop.time() - sent)))

    async def slow_disk() -> None:
        try:
            await asyncio.wait_for(spilling.wait(), 60)
            stuck.append(loop.time())
            await asyncio.sleep(2 * TTL_MS / 1000)  # the spill stays stuck for two TTLs
        finally:
            stuck.append(loop.time())
            loop.remove_reader(pipe)
            os.set_blocking(pipe, True)
            await asyncio.to_thread(lambda: [None for _ in iter(lambda: os.read(pipe, 1 << 20), b"")])
            os.close(pipe)

    await asyncio.gather(put, heads(), renewals(), slow_disk())
    # While the spill was held, only the spill waited. (The rest of the spill then writes to the
    # real disk, which on a loaded machine may slow Redis's fsync too: no bound is claimed there.)
    during = [seconds for sent, seconds in renewed if stuck[0] <= sent and sent + IN_TIME_S <= stuck[1]]
    assert len(during) >= 3 and max(during) < IN_TIME_S, (during, stuck, renewed)
    await client.delete_conversation(conv)  # free the disk for the other tests (the pipe goes too)
