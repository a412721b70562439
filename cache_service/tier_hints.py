"""The state tier's prefix checkpoints in the prefix index: the tier is a holder like a replica,
named TIER_HOLDER ("~tier"), so a router or worker that finds a prefix learns the tier has it.

- A committed put announces (scope, name, tokens) with the prefix TTL; a read announces again,
  since it kept the entry another TTL (the tier's TTL and the index's run from the same moments).
- Entries the tier let go (evicted over its prefix budget, expired, corrupt) are withdrawn
  after each put or read and at each sweep.

Hints, as every index entry: a withdraw that Redis did not take leaves a name pointing at a miss
until its TTL, and one racing a new put of the same name may hide it until its next read.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from cache_service.keys import PrefixKeys
from cache_service.logs import fields
from cache_service.prefix_store import PrefixIndexStore
from cache_service.prefix_tier import PrefixEntry
from cache_service.tier import StateTier
from proto.contract import TIER_HOLDER

log = logging.getLogger("cache_service.tier_hints")


class TierHints:
    def __init__(self, index: PrefixIndexStore, tier: StateTier, ttl_ms: int, batch: int):
        self._index = index
        self._tier = tier
        self._ttl_ms = ttl_ms
        self._batch = batch  # names per forget (Limits.max_prefix_entries)

    async def announce(self, entry: PrefixEntry) -> None:
        """After a put: errors propagate (the put is retried, and announces again)."""
        scope, name = entry.key
        await self._index.announce(PrefixKeys(scope), TIER_HOLDER, [(name, entry.tokens)], self._ttl_ms)
        await self.withdraw()

    async def refresh(self, entry: PrefixEntry) -> None:
        """After a read, which has its bytes already: Redis away only shortens the hint."""
        try:
            await self.announce(entry)
        except (RedisError, OSError) as exc:
            log.warning("prefix_hint_refresh_failed", extra=fields(error=str(exc)))

    async def sweep(self) -> int:
        """Drop the tier's expired prefix checkpoints and withdraw their names; returns how many."""
        expired = await asyncio.to_thread(self._tier.expire_prefixes)
        await self.withdraw()
        return expired

    async def withdraw(self) -> None:
        """Forget, for the tier, the names of the checkpoints it let go. Best effort."""
        by_scope: dict[str, list[str]] = {}
        for scope, name in await asyncio.to_thread(self._tier.take_withdrawn):
            by_scope.setdefault(scope, []).append(name)
        try:
            for scope, names in by_scope.items():
                for start in range(0, len(names), self._batch):
                    await self._index.forget(PrefixKeys(scope), TIER_HOLDER, names[start:start + self._batch])
        except (RedisError, OSError) as exc:
            log.warning("prefix_withdraw_failed", extra=fields(error=str(exc)))
