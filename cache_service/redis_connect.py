"""The service's Redis client: one URL, or the primary that Redis Sentinel names.

With Sentinel, every new connection asks the sentinels which server is the primary, and a
connection to a server that is no longer the primary (READONLY after a failover) is dropped:
once the sentinels have promoted a replica, the next call (the client's retry of an
UNAVAILABLE one) runs on it. Until then calls answer UNAVAILABLE, and health reports
NOT_SERVING (server.py), as for a single Redis that is down.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry


@dataclass(frozen=True)
class SentinelTarget:
    """The sentinels ("host:port" each) and the name of the primary they watch."""

    sentinels: tuple[str, ...]
    master_name: str
    # The primary's and replicas' password (requirepass); the sentinels themselves take none.
    password: str | None = None

    def __post_init__(self) -> None:
        if not self.sentinels or not self.master_name:
            raise ValueError("Sentinel needs at least one sentinel and the primary's name")
        for address in self.sentinels:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"a sentinel is host:port, got {address!r}")

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in self.sentinels]

    def __str__(self) -> str:
        return f"sentinel://{','.join(self.sentinels)}/{self.master_name}"


def connect(target: str | SentinelTarget, timeout_s: float) -> aioredis.Redis:
    # Few, fast retries: the service answers UNAVAILABLE soon and lets the client
    # back off; a long stall here would only eat the caller's deadline.
    options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                   retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 2),
                   retry_on_error=[RedisConnectionError, RedisTimeoutError], max_connections=256)
    if isinstance(target, str):
        return aioredis.Redis.from_url(target, **options)
    sentinel = Sentinel(target.addresses, sentinel_kwargs=dict(socket_timeout=timeout_s,
                                                               socket_connect_timeout=timeout_s))
    return sentinel.master_for(target.master_name, password=target.password, **options)
