"""Keeps the leases of running turns alive, from a thread and an event loop of its own.

    ingress event loop: SSE formatting of every stream, JSON, metrics ... (may stall)
    lease-keeper thread: its own loop and gRPC channel: renew every TTL/4, nothing else

A lease renewed on the ingress's own event loop lapses whenever that loop is kept busy past
the TTL (hundreds of streams, a replica loading beside it on the same cores); here, the only
wait before a renewal is the OS scheduling a thread.

The renewals run on a clock, not one after another: a tick sends a renewal whatever the
earlier ones are doing, so one slow reply cannot hold the next back. Each is one attempt,
without the client's retries (the next tick is the retry), bounded by when the lease would
lapse if it is not renewed: an answer after that is worth nothing, and one before it, however
slow, is not thrown away (cut at TTL/4, a service answering every renewal in TTL/3 would lose
every lease it in fact renewed).

    t:       0      T/4     T/2     3T/4     T
    sent:    ·───────────────────────────────x (slow: cut when the lease would lapse)
                    ·──ok   (renewed: the lease now lasts until T/4 + T at least)
                            ·──err  (UNKNOWN, INTERNAL ...: kept, logged, counted)

A turn is told its lease is lost only when that is certain: the service answered that the
lease is gone or fenced (LeaseLost), or a whole TTL has passed since the last renewal that
succeeded was sent. How late ticks ran (`hybridserve_lease_renewal_delay_max_seconds`) and how
long each RPC took, failures included (`hybridserve_lease_renewal_rpc_seconds`), are measured
so a TTL can be chosen with margin.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cache_service.client import CacheClient, ClientConfig, LeaseLost
from proto.contract import ConversationRef

log = logging.getLogger("hybridserve.ingress")
RENEWALS_PER_TTL = 4  # three renewals in a row may be slow or fail before the lease lapses


class Renewal(enum.Enum):
    """How one RenewLease call ended (the label of its latency)."""

    RENEWED = "renewed"
    FAILED = "failed"  # no verdict (deadline, unavailable, UNKNOWN, INTERNAL ...): the next tick retries
    LOST = "lost"      # the service says the lease is gone


class KeptLease:
    """One turn's lease under renewal; `stop()` when the turn ends."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future | None = None
        self.worst_delay_s = 0.0

    def stop(self) -> None:
        self.future.cancel()


class LeaseKeeper:
    def __init__(self, target: str, config: ClientConfig, on_delay: Callable[[float], None] = lambda _s: None,
                 on_renewal: Callable[[float, Renewal], None] = lambda _s, _r: None):
        self._target, self._config = target, config
        self.on_delay, self.on_renewal = on_delay, on_renewal
        self._loop = asyncio.new_event_loop()
        self.client: CacheClient | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="lease-keeper", daemon=True)
        self._thread.start()

    def keep(self, conv: ConversationRef, granted: Any, ttl_ms: int, on_lost: Callable[[LeaseLost], None]) -> KeptLease:
        """Renew `granted` every ttl/4 until stopped; `on_lost` (called once, on the keeper's
        thread) when the lease is certainly lost."""
        kept = KeptLease()
        kept.future = asyncio.run_coroutine_threadsafe(self._keep(conv, granted, ttl_ms, on_lost, kept), self._loop)
        return kept

    async def _keep(self, conv: ConversationRef, granted: Any, ttl_ms: int, on_lost, kept: KeptLease) -> None:
        if self.client is None:  # made on this thread's loop: a gRPC aio channel belongs to one loop
            self.client = CacheClient(self._target, self._config)
        await _Renewals(self, conv, granted, ttl_ms, on_lost, kept).run()

    def close(self) -> None:
        async def shut() -> None:
            if self.client is not None:
                await self.client.close()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


class _Renewals:
    """One lease's renewals, on the keeper's loop."""

    def __init__(self, keeper: LeaseKeeper, conv: ConversationRef, granted: Any, ttl_ms: int,
                 on_lost: Callable[[LeaseLost], None], kept: KeptLease):
        self.keeper, self.conv, self.granted, self.ttl_ms = keeper, conv, granted, ttl_ms
        self.on_lost, self.kept = on_lost, kept
        self.ttl_s = ttl_ms / 1000
        self.period_s = self.ttl_s / RENEWALS_PER_TTL
        # When the latest successful renewal was sent: the lease lasts a TTL from then at least.
        # It starts at the lease's grant, which happened just before the keeping began.
        self.renewed_at = time.monotonic()
        self.lost = asyncio.Event()
        self._told = False

    async def run(self) -> None:
        in_flight: set[asyncio.Task] = set()
        due = self.renewed_at + self.period_s
        try:
            while not await self._lost_before(due):
                now = time.monotonic()
                delay = now - due
                self.kept.worst_delay_s = max(self.kept.worst_delay_s, delay)
                self.keeper.on_delay(delay)
                if now - self.renewed_at >= self.ttl_s:
                    self._lose(LeaseLost(f"no renewal succeeded in {self.ttl_s:g} s: the lease has lapsed"))
                    return
                task = asyncio.create_task(self._renew_once())
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                # After a stall, one tick at once, then back on the clock (no burst of the missed ones).
                due = max(due + self.period_s, now)
        finally:
            for task in in_flight:
                task.cancel()

    async def _lost_before(self, due: float) -> bool:
        try:
            await asyncio.wait_for(self.lost.wait(), max(0.0, due - time.monotonic()))
            return True
        except TimeoutError:
            return False

    async def _renew_once(self) -> None:
        sent = time.monotonic()
        try:
            # At least a period: a renewal sent late (the keeper's thread starved) still gets a try.
            deadline_s = max(self.period_s, self.renewed_at + self.ttl_s - sent)
            await self.keeper.client.renew_lease(self.conv, self.granted, self.ttl_ms, timeout_s=deadline_s)
        except LeaseLost as e:
            self.keeper.on_renewal(time.monotonic() - sent, Renewal.LOST)
            self._lose(e)
            return
        except Exception as e:  # noqa: BLE001 -- whatever failed, the lease may still be held: the next tick retries
            self.keeper.on_renewal(time.monotonic() - sent, Renewal.FAILED)
            log.warning("lease renewal of %s failed after %.3f s (the next tick retries): %s: %s",
                        self.conv.id, time.monotonic() - sent, type(e).__name__, e)
            return
        self.keeper.on_renewal(time.monotonic() - sent, Renewal.RENEWED)
        self.renewed_at = max(self.renewed_at, sent)  # replies may come back out of order

    def _lose(self, error: LeaseLost) -> None:
        self.lost.set()
        if not self._told:
            self._told = True
            self.on_lost(error)
