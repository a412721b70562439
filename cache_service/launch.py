"""Start `python -m cache_service` as a child process and read the port it serves on.

The one way the app (deployments/service/host.py), the benchmarks and the tests start the
service. The child logs one JSON object per line on stderr; readiness is its `serving` event,
which carries the bound port (so `--port 0` works). Its log is drained for as long as it runs,
so it never blocks on a full pipe; each event goes to `on_event`.

A shared secret goes to the child through its stdin (`--auth-token-file /dev/stdin`: never on
disk or in its argv), a Redis URL (which may carry a password) through its environment
(`REDIS_URL`): a process's argv is readable by every user of the machine (`ps`). With `die_with_parent`, the child is started through util-linux
`setpriv --pdeathsig TERM` so it goes when its parent goes, however the parent dies.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from cache_service.embedded_redis import die_with_parent_prefix

REPO_ROOT = Path(__file__).resolve().parents[1]


class ServiceDidNotStart(RuntimeError):
    """The child exited, or did not log `serving` in time."""


class CacheServiceChild:
    """One `python -m cache_service <args>` child; `port` once it serves."""

    def __init__(self, args: Sequence[str], *, auth_token: str | None = None, redis_url: str | None = None,
                 root: Path = REPO_ROOT,
                 extra_env: Mapping[str, str] | None = None, die_with_parent: bool = False,
                 on_event: Callable[[dict], None] | None = None):
        self.args = list(args)
        self.auth_token = auth_token
        self.redis_url = redis_url
        self.root = root
        self.extra_env = dict(extra_env or {})
        self.die_with_parent = die_with_parent
        self.on_event = on_event
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._recent: collections.deque[dict] = collections.deque(maxlen=10)  # for the error message

    def start(self, timeout_s: float = 60.0) -> int:
        """Starts the child and waits for its `serving` event; returns the port."""
        argv = [*(die_with_parent_prefix() if self.die_with_parent else []), sys.executable, "-m", "cache_service",
                *self.args]
        if self.auth_token is not None:
            argv += ["--auth-token-file", "/dev/stdin"]
        env = {**os.environ, **self.extra_env,
               "PYTHONPATH": os.pathsep.join([str(self.root), os.environ.get("PYTHONPATH", "")])}
        env.pop("REDIS_URL", None)  # the service's Redis is the caller's to give, never inherited
        if self.redis_url:
            env["REDIS_URL"] = self.redis_url
        stdin = subprocess.PIPE if self.auth_token is not None else None
        self.proc = proc = subprocess.Popen(argv, cwd=self.root, env=env, stdin=stdin, stderr=subprocess.PIPE,
                                            text=True)
        if self.auth_token is not None:
            proc.stdin.write(self.auth_token)
            proc.stdin.close()
        serving = threading.Event()
        threading.Thread(target=self._drain, args=(proc, serving), name="cache-service-log", daemon=True).start()
        if not serving.wait(timeout_s) or proc.poll() is not None or self.port == 0:
            proc.kill()
            raise ServiceDidNotStart(f"the cache service did not start (exit code {proc.poll()}): "
                                     f"{list(self._recent)}")
        return self.port

    def _drain(self, proc: subprocess.Popen, serving: threading.Event) -> None:
        for line in proc.stderr:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = {"event": "raw", "line": line.rstrip()}
            self._recent.append(event)
            if self.on_event is not None:
                self.on_event(event)
            if event.get("event") == "serving":
                self.port = int(event["port"])
                serving.set()
        serving.set()  # EOF: the process exited

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after timeout_s; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
