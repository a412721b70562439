"""What every chaos client shares: the app's address, the report, the pace of the run, and the
small moves every kind of client makes (backing off, reading the service through its faults,
telling a legitimate expiry from a lost conversation)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai

from bench.chaos.plan import ChaosPlan, ClientKind, Report


class ClientGone(Exception):
    """This client hung up on purpose (a DISCONNECT fault): told nothing."""


class Session:
    def __init__(self, plan: ChaosPlan, base_url: str, model: str):
        self.plan, self.base_url, self.model = plan, base_url, model
        self.report = Report()
        self.salt = f"chaos-{plan.seed}"
        self.progress = asyncio.Condition()
        self.clients_done = asyncio.Event()
        self.openai = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.http = httpx.AsyncClient(base_url=base_url, timeout=120)

    async def close(self) -> None:
        await self.openai.close()
        await self.http.aclose()

    async def committed(self, kind: ClientKind) -> None:
        async with self.progress:
            self.report.committed += 1
            self.report.committed_by_kind[kind] += 1
            self.progress.notify_all()

    def told_error(self, error: Exception) -> None:
        self.report.failed_and_told += 1
        self.report.errors_seen[getattr(error, "status_code", None) or type(error).__name__] += 1

    def diverged(self, what: str) -> None:
        self.report.divergences.append(what)

    async def backoff(self, attempt: int) -> None:
        """As a client would: wait before trying again (503s say Retry-After: 1)."""
        if attempt:
            await asyncio.sleep(min(2.0, 0.25 * 2 ** (attempt - 1)))

    def may_have_expired(self, last_commit_sent: float) -> bool:
        """A conversation can have expired only once its TTL has run since its last turn was
        committed, which was after that turn's request was sent."""
        ttl = self.plan.conversation_ttl_s
        return bool(ttl) and time.monotonic() - last_commit_sent >= ttl - 0.5

    async def idle_past_ttl(self) -> None:
        """The TTL_EXPIRY fault: this client says nothing for longer than the retention. A lease
        (each attempt takes one, an Idempotency-Key replay too) sets the keys' TTL to the
        retention plus the lease's TTL, so that a turn's keys outlive its lease; the idle time
        outlasts both."""
        await asyncio.sleep(self.plan.conversation_ttl_s + self.plan.lease_ttl_s + 2.0)

    async def read(self, method: str, path: str, **params: Any) -> httpx.Response:
        """A read (or DELETE) that rides out the faults: answers other than 5xx are final."""
        for attempt in range(self.plan.max_attempts):
            await self.backoff(attempt)
            try:
                r = await self.http.request(method, path, params={"cache_salt": self.salt, **params})
            except httpx.HTTPError:
                continue
            if r.status_code < 500:
                return r
        raise RuntimeError(f"{method} {path} never answered")

    async def told_items(self, conv_id: str) -> list[tuple[str, str]] | None:
        """The conversation as its clients were told it, (role, text) per message; None if it
        does not exist."""
        r = await self.read("GET", f"/v1/conversations/{conv_id}/items", order="asc")
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return [(item["role"], "".join(part["text"] for part in item["content"]))
                for item in r.json()["data"] if item["type"] == "message"]
