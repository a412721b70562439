"""The service's Redis client: one URL, the primary that Redis Sentinel names, or a Redis Cluster.

With Sentinel, every new connection asks the sentinels which server is the primary, and a
connection to a server that is no longer the primary (READONLY after a failover) is dropped:
once the sentinels have promoted a replica, the next call (the client's retry of an
UNAVAILABLE one) runs on it. Until then calls answer UNAVAILABLE, and health reports
NOT_SERVING (server.py), as for a single Redis that is down.

With a Cluster, redis-py's RedisCluster learns the slot map from the nodes given and routes each
command (each script: all of its keys share one hash tag, keys.py) to the primary of its slot;
after a failover a MOVED reply makes it reload the map, and the retry runs on the promoted node.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry


def _address(text: str, what: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a {what} is host:port, got {text!r}")
    return host, int(port)


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
            _address(address, "sentinel")

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [_address(a, "sentinel") for a in self.sentinels]

    def __str__(self) -> str:
        return f"sentinel://{','.join(self.sentinels)}/{self.master_name}"


@dataclass(frozen=True)
class ClusterTarget:
    """Some nodes ("host:port" each) of a Redis Cluster: the client learns the others from them."""

    nodes: tuple[str, ...]
    password: str | None = None

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a Redis Cluster needs at least one node")
        for address in self.nodes:
            _address(address, "cluster node")

    def __str__(self) -> str:
        return f"cluster://{','.join(self.nodes)}"


RedisTarget = str | SentinelTarget | ClusterTarget


def connect(target: RedisTarget, timeout_s: float) -> aioredis.Redis | RedisCluster:
    # Few, fast retries: the service answers UNAVAILABLE soon and lets the client
    # back off; a long stall here would only eat the caller's deadline.
    options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                   retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 2),
                   retry_on_error=[RedisConnectionError, RedisTimeoutError], max_connections=256)
    if isinstance(target, str):
        return aioredis.Redis.from_url(target, **options)
    if isinstance(target, ClusterTarget):
        return RedisCluster(startup_nodes=[ClusterNode(*_address(a, "cluster node")) for a in target.nodes],
                            password=target.password, **options)
    sentinel = Sentinel(target.addresses, sentinel_kwargs=dict(socket_timeout=timeout_s,
                                                               socket_connect_timeout=timeout_s))
    return sentinel.master_for(target.master_name, password=target.password, **options)
