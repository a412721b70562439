"""A real Redis primary, its replicas and three sentinels on loopback, for failover tests.

Every process is the redis-server binary the service embeds (find_redis_server), sentinels
run it with `--sentinel`. Readiness is read from each process's own log lines; the sentinels'
view of one another is polled with a deadline (they discover each other through hello
messages every 2 s).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import redis

from cache_service.embedded_redis import die_with_parent_prefix, find_redis_server, free_port

MASTER_NAME = "hs-primary"


class RedisChild:
    """One redis-server process whose log lines are kept and can be awaited."""

    def __init__(self, argv: list[str], port: int):
        self.port = port
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        self.proc = subprocess.Popen(die_with_parent_prefix() + argv, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line.rstrip())
                self._new_line.notify_all()

    def wait_line(self, text: str, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._new_line:
            while True:
                for line in self.lines[seen:]:
                    if text in line:
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"port {self.port} never logged {text!r}:\n" + "\n".join(self.lines[-20:]))
                self._new_line.wait(left)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


class RedisSentinelSet:
    """A primary, `replicas` replicas and 3 sentinels (quorum 2) watching MASTER_NAME
    (`with_sentinels=False`: the primary and its replicas only)."""

    def __init__(self, root: Path, replicas: int = 2, down_after_ms: int = 500, with_sentinels: bool = True):
        self.root = root
        self.binary = str(find_redis_server())
        self.servers: list[RedisChild] = []
        self.sentinels: list[RedisChild] = []
        self.replicas = replicas
        self.down_after_ms = down_after_ms
        self.with_sentinels = with_sentinels

    @property
    def sentinel_addresses(self) -> str:
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    def _server(self, name: str, *extra: str) -> RedisChild:
        port, data = free_port(), self.root / name
        data.mkdir()
        child = RedisChild([self.binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data),
                            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                            "--maxmemory-policy", "noeviction", *extra], port)
        self.servers.append(child)
        child.wait_line("Ready to accept connections")
        return child

    def add_replica(self) -> RedisChild:
        """A replica of the first primary, returned once its first sync finished."""
        replica = self._server(f"replica{len(self.servers)}", "--replicaof", "127.0.0.1", str(self.primary.port))
        replica.wait_line("MASTER <-> REPLICA sync: Finished with success")
        return replica

    def start(self) -> "RedisSentinelSet":
        primary = self._server("primary")
        for _ in range(self.replicas):
            self.add_replica()
        for i in range(3 if self.with_sentinels else 0):
            port = free_port()
            conf = self.root / f"sentinel{i}.conf"
            conf.write_text(f"bind 127.0.0.1\nport {port}\ndir {self.root}\n"
                            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary.port} 2\n"
                            f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {MASTER_NAME} 5000\n")
            sentinel = RedisChild([self.binary, str(conf), "--sentinel"], port)
            self.sentinels.append(sentinel)
            sentinel.wait_line("+monitor master")
        if self.with_sentinels:
            self._await_sentinels_agree(timeout_s=20.0)
        return self

    def _await_sentinels_agree(self, timeout_s: float) -> None:
        """Until every sentinel knows the two others and every replica: a failover needs both."""
        deadline = time.monotonic() + timeout_s
        while True:
            views = [s.client().sentinel_master(MASTER_NAME) for s in self.sentinels]
            if all(v["num-other-sentinels"] == 2 and v["num-slaves"] == self.replicas for v in views):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"sentinels never saw each other and the replicas: {views}")
            time.sleep(0.1)  # polling another process's view; there is no event to await

    @property
    def primary(self) -> RedisChild:
        return self.servers[0]

    def promoted(self, timeout_s: float = 20.0) -> RedisChild:
        """The server a sentinel switched the primary to (its `+switch-master` line)."""
        line = self.sentinels[0].wait_line("+switch-master", timeout_s)
        port = int(line.split()[-1])
        return next(s for s in self.servers if s.port == port)

    def close(self) -> None:
        for child in self.sentinels + self.servers:
            child.kill()

    def __enter__(self) -> "RedisSentinelSet":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
