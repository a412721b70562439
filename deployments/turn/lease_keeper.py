"""Keeps the leases of running turns alive, from a thread and an event loop of its own.

    ingress event loop: SSE formatting of every stream, JSON, metrics ... (may stall)
    lease-keeper thread: its own loop and gRPC channel: renew every TTL/4, nothing else

A lease renewed on the ingress's own event loop lapses whenever that loop is kept busy past
the TTL (hundreds of streams, a replica loading beside it on the same cores); here, the only
wait before a renewal is the OS scheduling a thread. How late renewals ran is measured (the
worst delay, `hybridserve_lease_renewal_delay_max_seconds`) so a TTL can be chosen with margin.
A lease found lost is reported back to its turn, which stops at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cache_service.client import CacheClient, CacheError, ClientConfig, LeaseLost
from proto.contract import ConversationRef

log = logging.getLogger("hybridserve.ingress")
RENEWALS_PER_TTL = 4  # two renewals may be late or lost before the lease lapses


class KeptLease:
    """One turn's lease under renewal; `stop()` when the turn ends."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future | None = None
        self.worst_delay_s = 0.0

    def stop(self) -> None:
        self.future.cancel()


class LeaseKeeper:
    def __init__(self, target: str, config: ClientConfig, on_delay: Callable[[float], None] = lambda _s: None):
        self._target, self._config, self._on_delay = target, config, on_delay
        self._loop = asyncio.new_event_loop()
        self._client: CacheClient | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="lease-keeper", daemon=True)
        self._thread.start()

    def keep(self, conv: ConversationRef, granted: Any, ttl_ms: int, on_lost: Callable[[LeaseLost], None]) -> KeptLease:
        """Renew `granted` every ttl/4 until stopped; `on_lost` (called on the keeper's thread)
        when the service says the lease is gone."""
        kept = KeptLease()
        kept.future = asyncio.run_coroutine_threadsafe(self._renew(conv, granted, ttl_ms, on_lost, kept), self._loop)
        return kept

    async def _renew(self, conv: ConversationRef, granted: Any, ttl_ms: int, on_lost, kept: KeptLease) -> None:
        if self._client is None:  # made on this thread's loop: a gRPC aio channel belongs to one loop
            self._client = CacheClient(self._target, self._config)
        period = ttl_ms / 1000 / RENEWALS_PER_TTL
        due = time.monotonic() + period
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            delay = time.monotonic() - due
            kept.worst_delay_s = max(kept.worst_delay_s, delay)
            self._on_delay(delay)
            due += period
            try:
                await self._client.renew_lease(conv, granted, ttl_ms)
            except LeaseLost as e:
                on_lost(e)
                return
            except CacheError as e:  # retried at the next period, well inside the TTL
                log.warning("lease renewal of %s failed (retrying): %s", conv.id, e)

    def close(self) -> None:
        async def shut() -> None:
            if self._client is not None:
                await self._client.close()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
