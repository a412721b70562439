"""The cache-service instances one client talks to: a channel each, which look live, whom to ask.

    metadata RPC ──> any(): this client's preferred instance while it answers; after an
                     UNAVAILABLE it is marked down for `down_s` and another live one is picked
    tier entry   ──> ranked(key): the live instances in rendezvous order (placement.py), then the
                     ones marked down (they may be back: a walk still reaches them last)

Membership is the configured addresses plus what the DNS names resolve to, re-resolved every
`refresh_s` and soon after an instance failed (a headless Service drops a dead pod's address once
its readiness fails). A name that does not resolve keeps the last answer. Channels of instances
that left stay open until the client closes: closing one would cut calls still running on it,
and pods come and go far too rarely for the leftovers to matter.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections.abc import Callable

import grpc

from cache_service import placement
from cache_service.errors import Unavailable
from cache_service.logs import fields
from cache_service.placement import Targets
from proto import cache_pb2_grpc

log = logging.getLogger("cache_service.client")
# After an instance failed, the soonest DNS is asked again (a burst of failures asks once).
MIN_REFRESH_GAP_S = 0.5


class InstancePool:
    def __init__(self, targets: Targets, make_channel: Callable[[str], grpc.aio.Channel], *,
                 refresh_s: float, down_s: float):
        self.targets = targets
        self._make_channel = make_channel
        self._refresh_s, self._down_s = refresh_s, down_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, cache_pb2_grpc.CacheServiceStub] = {}
        self._members: list[str] = list(targets.addresses)
        self._resolved: dict[tuple[str, int], list[str]] = {}  # each name's last answer
        self._resolved_at = -float("inf")
        self._refresh: asyncio.Task | None = None
        self._down_until: dict[str, float] = {}
        self._preferred: str | None = None

    @property
    def single(self) -> bool:
        return self.targets.single

    # -- membership -------------------------------------------------------------------

    async def members(self) -> list[str]:
        """The current instances. The first call waits for DNS; later ones refresh in the background."""
        if not self.targets.dns_names:
            return self._members
        if not self._members:  # not resolved yet, or resolved to nothing: no one to call but DNS
            await self._resolve()
        elif time.monotonic() - self._resolved_at > self._refresh_s:
            self._refresh_soon()
        if not self._members:
            raise Unavailable(f"no cache-service instance: {self.targets.dns_names} resolved to nothing")
        return self._members

    def _refresh_soon(self) -> None:
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._resolve(), name="cache-dns-refresh")

    async def _resolve(self) -> None:
        loop = asyncio.get_running_loop()
        for host, port in self.targets.dns_names:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:  # keep what the name said last time
                log.warning("cache_dns_failed", extra=fields(host=host, error=str(exc)))
                continue
            self._resolved[(host, port)] = placement.addresses_of(infos, port)
        found = [a for name in self.targets.dns_names for a in self._resolved.get(name, ())]
        self._members = list(dict.fromkeys([*self.targets.addresses, *found]))
        self._resolved_at = time.monotonic()

    # -- choosing ---------------------------------------------------------------------

    def stub(self, address: str) -> cache_pb2_grpc.CacheServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            self._channels[address] = channel = self._make_channel(address)
            self._stubs[address] = stub = cache_pb2_grpc.CacheServiceStub(channel)
        return stub

    def _live(self, members: list[str]) -> list[str]:
        now = time.monotonic()
        return [m for m in members if self._down_until.get(m, 0.0) <= now]

    async def any(self) -> str:
        """An instance for a metadata RPC: the preferred one while it is a live member, else a
        random live one (clients spread over the instances), else any member."""
        members = await self.members()
        live = self._live(members)
        if self._preferred not in live:
            self._preferred = random.choice(live or members)
        return self._preferred

    async def ranked(self, key: str) -> list[str]:
        """Every member in the entry's rendezvous order, the live ones first."""
        order = placement.rank(key, await self.members())
        live = set(self._live(order))
        return [m for m in order if m in live] + [m for m in order if m not in live]

    def mark_down(self, address: str) -> None:
        """`address` answered UNAVAILABLE: skip it for a while and ask DNS again soon."""
        if self.single:
            return  # nothing to fail over to: the retry loop keeps trying it, as it always did
        self._down_until[address] = time.monotonic() + self._down_s
        if self._preferred == address:
            self._preferred = None
        if self.targets.dns_names and time.monotonic() - self._resolved_at > MIN_REFRESH_GAP_S:
            self._refresh_soon()

    def channel(self, address: str) -> grpc.aio.Channel:
        self.stub(address)
        return self._channels[address]

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        await asyncio.gather(*(c.close() for c in self._channels.values()))
