"""The prefix index on Redis: one scope's names per slot (keys.PrefixKeys), scopes over the shards.

Each call touches one scope, so each script runs on the one node that holds the scope's slot.
Stats needs the live names of every scope: the scopes with live names are listed in one sorted
set (keys.PREFIX_SCOPES), so counting them is one ZCOUNT per listed scope (pipelined, one round
trip per node), never a SCAN. That set is written at most once per TTL per scope and instance
(`_registered`), not on every announce, so its one slot is no hot spot.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import redis.asyncio as aioredis

from cache_service import scripts
from cache_service.keys import PREFIX_SCOPES, PrefixKeys

# Scopes whose registration this process remembers (the oldest forgotten: one ZADD again).
_REGISTRATIONS_KEPT = 65536


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class PrefixIndexStore:
    def __init__(self, redis: aioredis.Redis):
        self._redis = redis
        self._announce = redis.register_script(scripts.ANNOUNCE_PREFIXES)
        self._forget = redis.register_script(scripts.FORGET_PREFIXES)
        self._find = redis.register_script(scripts.FIND_PREFIX)
        self._registered: OrderedDict[str, int] = OrderedDict()  # scope -> listed until (Unix ms)

    async def announce(self, keys: PrefixKeys, replica: str, entries: list[tuple[str, int]], ttl_ms: int) -> None:
        now = now_ms()
        args: list[str | int] = [replica, now, ttl_ms]
        for name, tokens in entries:
            args += [name, tokens]
        await self._announce(keys=[keys.live, *(keys.name(n) for n, _ in entries)], args=args)
        await self._list_scope(keys.scope, now, ttl_ms)

    async def _list_scope(self, scope: str, now: int, ttl_ms: int) -> None:
        """Keep the scope listed past its names' expiry (now + ttl): listed for two TTLs, again
        once less than one is left, so the listing always outlives the names announced."""
        if self._registered.get(scope, 0) >= now + ttl_ms:
            self._registered.move_to_end(scope)
            return
        until = now + 2 * ttl_ms
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zadd(PREFIX_SCOPES, {scope: until})
            pipe.zremrangebyscore(PREFIX_SCOPES, "-inf", now)  # scopes whose names all expired
            await pipe.execute()
        self._registered[scope] = until
        self._registered.move_to_end(scope)
        while len(self._registered) > _REGISTRATIONS_KEPT:
            self._registered.popitem(last=False)

    async def forget(self, keys: PrefixKeys, replica: str, names: list[str]) -> None:
        await self._forget(keys=[keys.live, *map(keys.name, names)], args=[replica, *names])

    async def find(self, keys: PrefixKeys, names: list[str]) -> tuple[int, list[tuple[str, int, int]]]:
        """(the highest index whose name has a live holder, [(replica, tokens of its longest
        prefix among names, that one's index)]); (-1, []) if none."""
        if not names:
            return -1, []
        index, flat = await self._find(keys=list(map(keys.name, names)), args=[now_ms()])
        return int(index), [(flat[i].decode(), int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)]

    async def live_names(self) -> int:
        """Names with a live entry (not expired, not forgotten by every holder), all scopes."""
        now = now_ms()
        scopes = {s.decode() for s in await self._redis.zrangebyscore(PREFIX_SCOPES, f"({now}", "+inf")}
        scopes.add("")  # names announced without a scope (and before scopes existed)
        async with self._redis.pipeline(transaction=False) as pipe:
            for scope in sorted(scopes):
                pipe.zcount(PrefixKeys(scope).live, f"({now}", "+inf")
            return sum(await pipe.execute())
