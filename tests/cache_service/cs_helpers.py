"""Helpers shared by the cache-service tests (imported as a plain module)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cache_service.client import CacheClient, ClientConfig, RetryPolicy
from proto.contract import ConversationRef, tokens_digest

REPO_ROOT = Path(__file__).resolve().parents[2]
# The checkout whose `python -m cache_service` the tests start. Pointing it at an older
# checkout runs today's tests against yesterday's service: that is how a regression
# test is seen to fail before its fix. Service settings below travel as environment
# variables (which an older service ignores) rather than flags (which it would refuse).
SERVICE_ROOT = Path(os.environ.get("HS_CACHE_SERVICE_ROOT", REPO_ROOT))


@dataclass
class History:
    """What a worker would know about a conversation: its committed tokens."""

    tokens: list[int] = field(default_factory=list)
    version: int = 0


async def commit_turn(client: CacheClient, conv: ConversationRef, history: History, new_tokens: list[int],
                      text: str, *, owner: str = "replica-0") -> None:
    lease = await client.acquire_lease(conv, ttl_ms=10_000, wait_s=5.0)
    tokens = history.tokens + new_tokens
    head = await client.publish_turn(
        conv, lease_token=lease.token, expected_version=history.version,
        messages=[{"role": "user", "content": text}, {"role": "assistant", "content": f"re: {text}"}],
        token_ids=new_tokens, committed_tokens=len(tokens), tokens_sha256=tokens_digest(tokens),
        owner_replica=owner)
    assert head.version == history.version + 1
    history.tokens, history.version = tokens, head.version


TIER_BUDGET = 16 << 20


class ServiceProcess:
    """`python -m cache_service` as a child process; restartable on the same port."""

    def __init__(self, *, data_dir: Path, redis_url: str | None, tier_budget: int = TIER_BUDGET,
                 extra_env: dict[str, str] | None = None):
        self.data_dir = data_dir
        self.redis_url = redis_url
        self.tier_budget = tier_budget
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.events: list[dict] = []
        self._new_event = threading.Condition()
        self._extra_env = extra_env or {}

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        argv = [sys.executable, "-m", "cache_service", "--port", str(self.port),
                "--data-dir", str(self.data_dir), "--tier-budget", str(self.tier_budget),
                "--grace-s", "2"]
        if self.redis_url:
            argv += ["--redis-url", self.redis_url]
        env = {**os.environ, "PYTHONPATH": str(SERVICE_ROOT), **self._extra_env}
        env.pop("REDIS_URL", None)
        self.proc = subprocess.Popen(argv, cwd=SERVICE_ROOT, env=env, stderr=subprocess.PIPE, text=True)
        serving = threading.Event()
        proc = self.proc

        def drain() -> None:
            for line in proc.stderr:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    event = {"event": "raw", "line": line.rstrip()}
                with self._new_event:
                    self.events.append(event)
                    self._new_event.notify_all()
                if event.get("event") == "serving":
                    self.port = event["port"]
                    serving.set()
            serving.set()  # EOF: exited

        threading.Thread(target=drain, daemon=True).start()
        if not serving.wait(timeout_s) or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"cache service did not start: {self.events[-10:]}")

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> int:
        return self._signal(signal.SIGTERM)

    def _signal(self, sig: signal.Signals) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(30)

    def close(self) -> None:
        """Kill the process if a failed test left it running."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()

    def event(self, name: str) -> dict:
        return next(e for e in self.events if e.get("event") == name)

    def wait_event(self, predicate, timeout_s: float = 30.0) -> dict:
        """Block until the service logs an event matching predicate (use via to_thread)."""
        seen = 0
        with self._new_event:
            while True:
                for event in self.events[seen:]:
                    if predicate(event):
                        return event
                seen = len(self.events)
                if not self._new_event.wait(timeout_s):
                    raise TimeoutError("the service never logged the awaited event")


def fast_client(target: str, auth_token: str | None = None) -> CacheClient:
    # Tests want quick retries but enough of them to ride out a process restart.
    return CacheClient(target, ClientConfig(
        timeout_s=5.0, retry=RetryPolicy(attempts=100, initial_backoff_s=0.01, max_backoff_s=0.25),
        auth_token=auth_token))
