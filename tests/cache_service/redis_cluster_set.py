"""A real Redis Cluster on loopback: three primaries (and optionally one replica each).

Every node is the redis-server binary the service embeds, run with `--cluster-enabled yes`;
`redis-cli --cluster create` assigns the 16384 slots and the replicas. Readiness is read from
each node's own log ("Cluster state changed: ok"), never polled.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import redis
from redis_sentinel_set import RedisChild

from cache_service.embedded_redis import find_redis_server

PRIMARIES = 3
T = TypeVar("T")
BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000, so the port must be <= 55535


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A port free on loopback whose bus port is free too."""
    while True:
        port = random.randrange(20000, 65536 - BUS_OFFSET)
        if _free(port) and _free(port + BUS_OFFSET):
            return port


class RedisClusterSet:
    def __init__(self, root: Path, replicas_per_primary: int = 0):
        self.root = root
        self.binary = find_redis_server()
        self.replicas_per_primary = replicas_per_primary
        self.nodes: list[RedisChild] = []

    @property
    def addresses(self) -> str:
        """The flag's value: every node, though one is enough for the client to find the rest."""
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def _node(self, index: int) -> RedisChild:
        port, data = cluster_port(), self.root / f"node{index}"
        data.mkdir()
        child = RedisChild([str(self.binary), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data),
                            "--cluster-enabled", "yes", "--cluster-config-file", str(data / "nodes.conf"),
                            "--cluster-node-timeout", "1000", "--appendonly", "yes", "--appendfsync", "always",
                            "--save", "", "--maxmemory-policy", "noeviction"], port)
        child.wait_line("Ready to accept connections")
        return child

    def start(self) -> "RedisClusterSet":
        for i in range(PRIMARIES * (1 + self.replicas_per_primary)):
            self.nodes.append(self._node(i))
        cli = self.binary.with_name("redis-cli")
        subprocess.run([str(cli), "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas_per_primary), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        for node in self.nodes:
            node.wait_line("Cluster state changed: ok", 30)
        return self

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=5)

    def nodes_of_slot(self, slot: int) -> tuple[RedisChild, list[RedisChild]]:
        """The primary serving `slot` now, and its replicas."""
        for first, last, primary, *replicas in self.nodes[0].client().execute_command("CLUSTER SLOTS"):
            if first <= slot <= last:
                by_port = {n.port: n for n in self.nodes}
                return by_port[primary[1]], [by_port[r[1]] for r in replicas]
        raise KeyError(slot)

    def node_of_slot(self, slot: int) -> RedisChild:
        return self.nodes_of_slot(slot)[0]

    def spread(self, candidates: Iterable[T], slot_of: Callable[[T], int], per_primary: int) -> list[T]:
        """`per_primary` of `candidates` on each primary, taken in turn from each: a test that must reach
        every shard picks its keys so, rather than hope that random names happen to cover them (twelve
        random names miss one of three primaries once in 43 runs)."""
        ranges = [(first, last, primary[1]) for first, last, primary, *_ in
                  self.nodes[0].client().execute_command("CLUSTER SLOTS")]
        chosen: dict[int, list[T]] = {}
        for candidate in candidates:
            slot = slot_of(candidate)
            port = next(port for first, last, port in ranges if first <= slot <= last)
            bucket = chosen.setdefault(port, [])
            if len(bucket) < per_primary:
                bucket.append(candidate)
            if len(chosen) == PRIMARIES and all(len(b) == per_primary for b in chosen.values()):
                return [c for group in zip(*chosen.values()) for c in group]
        raise ValueError(f"the candidates reach {len(chosen)} of {PRIMARIES} primaries {per_primary} times each")

    @staticmethod
    def promoted(candidates: list[RedisChild], timeout_s: float = 30.0) -> RedisChild:
        """The replica among `candidates` that won the failover election (its own log line)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for node in candidates:  # each waited on briefly in turn: any of them may win
                try:
                    node.wait_line("Failover election won", 0.05)
                    return node
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise

    def close(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> "RedisClusterSet":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
