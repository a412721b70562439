"""Helpers shared by the cache-service tests (imported as a plain module)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cache_service.client import CacheClient, ClientConfig, RetryPolicy
from cache_service.launch import CacheServiceChild
from proto.contract import ConversationRef, tokens_digest

# The strict service (conftest `strict_service`): small bounds and authentication on.
STRICT_TOKEN = "strict-test-secret-0123456789"
STRICT_STAGED_BYTES = 8 << 20
STRICT_TIER_BUDGET = 4 << 20

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
        args = ["--port", str(self.port), "--data-dir", str(self.data_dir), "--tier-budget", str(self.tier_budget),
                "--grace-s", "2"]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        child = CacheServiceChild(args, root=SERVICE_ROOT, extra_env=self._extra_env, on_event=self._record)
        self.proc = None
        try:
            self.port = child.start(timeout_s)
        finally:
            self.proc = child.proc

    def _record(self, event: dict) -> None:
        with self._new_event:
            self.events.append(event)
            self._new_event.notify_all()

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
