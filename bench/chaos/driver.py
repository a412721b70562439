"""The chaos property, checked against a running app: what every client was told is what the
service's ledger holds.

    clients (N conversations, turn after turn, each turn with its own Idempotency-Key)
      attempt ──ok──────────────> the turn is the client's: (user text, reply) recorded
              ──error / gone───> retried with the same key until it succeeds
    injector (seeded times): worker SIGKILL, cache-service restart, Redis SIGSTOP..SIGCONT
    clients (seeded per attempt): hang up mid-stream, send the same attempt twice at once

    at the end, per conversation:
      ledger turns == the recorded turns, in order, none twice      (integrity)
      every head the service names serves a next turn               (attachable)
      each recorded reply == a fault-free stateless replay           (exactness, greedy)

A divergence is any of these failing; the run reports them with the counts of turns attempted,
committed, failed-and-told, and faults injected by kind. The test (`tests/serve/test_chaos.py`)
and the benchmark (`python -m bench.chaos`) run this one driver on stacks of their own.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import httpx
import openai


class Fault(str, Enum):
    DISCONNECT = "client disconnect mid-stream"
    DUPLICATE = "concurrent duplicate retry"
    KILL_WORKER = "worker SIGKILL"
    RESTART_SERVICE = "cache-service restart"
    PAUSE_REDIS = "Redis SIGSTOP/SIGCONT"


class Infrastructure(Protocol):
    """The faults a stack can suffer; each returns once the fault is over (the process restarted
    or resumed), not once the system recovered from it."""

    async def kill_worker(self, replica_id: str) -> None: ...

    async def restart_service(self) -> None: ...

    async def pause_redis(self, seconds: float) -> None: ...

    async def settled(self) -> None:
        """Every replica runs again (a killed one was replaced)."""


@dataclass(frozen=True)
class ChaosPlan:
    conversations: int = 8
    turns: int = 4
    max_tokens: int = 8
    seed: int = 0
    disconnect_rate: float = 0.15  # of attempts: hang up after the first streamed token
    duplicate_rate: float = 0.15   # of attempts: the same attempt sent twice at once
    infra_faults: tuple[Fault, ...] = (Fault.KILL_WORKER, Fault.RESTART_SERVICE, Fault.PAUSE_REDIS)
    infra_every_turns: int = 7     # an infrastructure fault after about every this many committed turns
    redis_pause_s: float = 12.0    # longer than the cache client's per-call deadline
    max_attempts: int = 60
    budget_s: float = 600.0


@dataclass
class Recorded:
    user: str
    reply: str
    turn: int


@dataclass
class Report:
    attempts: int = 0
    committed: int = 0
    failed_and_told: int = 0
    faults: Counter = field(default_factory=Counter)
    divergences: list[str] = field(default_factory=list)
    errors_seen: Counter = field(default_factory=Counter)
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return {"attempts": self.attempts, "committed": self.committed, "failed_and_told": self.failed_and_told,
                "faults": {f.value: n for f, n in self.faults.items()}, "faults_total": sum(self.faults.values()),
                "divergences": self.divergences, "errors_seen": dict(self.errors_seen), "wall_s": self.wall_s}


class ClientGone(Exception):
    """This client hung up on purpose (a DISCONNECT fault): told nothing."""


class ChaosRun:
    def __init__(self, plan: ChaosPlan, base_url: str, model: str, infra: Infrastructure):
        self.plan, self.base_url, self.model, self.infra = plan, base_url, model, infra
        self.report = Report()
        self.recorded: dict[str, list[Recorded]] = {}
        self._rng = random.Random(plan.seed)
        self._clients_done = asyncio.Event()
        self._progress = asyncio.Condition()
        self.salt = f"chaos-{plan.seed}"

    # -- driving ---------------------------------------------------------------------------
    async def run(self) -> Report:
        started = time.monotonic()
        client = openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        ids = [f"chaos-{self.plan.seed}-{i}-{uuid.uuid4().hex[:6]}" for i in range(self.plan.conversations)]
        for conv_id in ids:
            self.recorded[conv_id] = []
        injector = asyncio.create_task(self._inject(ids))
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self._conversation(client, conv_id, i) for i, conv_id in enumerate(ids))),
                self.plan.budget_s)
        finally:
            async with self._progress:
                self._clients_done.set()
                self._progress.notify_all()
            await injector
        await self.infra.settled()
        await self._check(client, ids)
        self.report.wall_s = time.monotonic() - started
        return self.report

    async def _conversation(self, client: openai.AsyncOpenAI, conv_id: str, index: int) -> None:
        rng = random.Random(f"{self.plan.seed}:{index}")
        for turn in range(1, self.plan.turns + 1):
            text = f"conversation {index} turn {turn}: {rng.randrange(10**6)}"
            key = uuid.uuid4().hex
            for attempt in range(self.plan.max_attempts):
                if attempt:  # as a client would: back off before trying again (503s say Retry-After: 1)
                    await asyncio.sleep(min(2.0, 0.25 * 2 ** (attempt - 1)))
                self.report.attempts += 1
                outcome = await self._attempt(client, conv_id, text, key, rng)
                if outcome is not None:
                    self.recorded[conv_id].append(Recorded(text, outcome[0], outcome[1]))
                    async with self._progress:
                        self.report.committed += 1
                        self._progress.notify_all()
                    break
            else:
                self.report.divergences.append(f"{conv_id}: turn {turn} never succeeded in "
                                               f"{self.plan.max_attempts} attempts")
                return

    async def _attempt(self, client, conv_id: str, text: str, key: str, rng: random.Random) -> tuple[str, int] | None:
        """(reply, turn) if this attempt told its client the turn succeeded, else None."""
        roll = rng.random()
        if roll < self.plan.duplicate_rate:
            self.report.faults[Fault.DUPLICATE] += 1
            outcomes = await asyncio.gather(self._send(client, conv_id, text, key, hang_up=False),
                                            self._send(client, conv_id, text, key, hang_up=False))
            told = [o for o in outcomes if o is not None]
            if len(told) == 2 and told[0] != told[1]:
                self.report.divergences.append(f"{conv_id}: one key, two answers: {told}")
            return told[0] if told else None
        hang_up = roll < self.plan.duplicate_rate + self.plan.disconnect_rate
        if hang_up:
            self.report.faults[Fault.DISCONNECT] += 1
        return await self._send(client, conv_id, text, key, hang_up=hang_up)

    async def _send(self, client, conv_id: str, text: str, key: str, *, hang_up: bool) -> tuple[str, int] | None:
        try:
            stream = await client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": text}], max_tokens=self.plan.max_tokens,
                temperature=0, stream=True, extra_headers={"Idempotency-Key": key},
                extra_body={"conversation_id": conv_id, "cache_salt": self.salt, "wait_if_busy": True})
            parts, turn, finished = [], None, False
            async with stream:
                async for chunk in stream:
                    for choice in chunk.choices:
                        parts.append(choice.delta.content or "")
                        finished = finished or choice.finish_reason is not None
                    turn = (chunk.model_extra or {}).get("turn", turn)
                    if hang_up and "".join(parts):
                        raise ClientGone
            if not finished or turn is None:
                raise openai.APIError("the stream ended without a finished turn", request=None, body=None)
            return "".join(parts), turn
        except ClientGone:
            return None
        except (openai.APIError, httpx.HTTPError) as e:
            self.report.failed_and_told += 1
            self.report.errors_seen[getattr(e, "status_code", None) or type(e).__name__] += 1
            return None

    async def _inject(self, ids: list[str]) -> None:
        """Infrastructure faults in turn, each after a seeded number of committed turns (so every
        kind happens while clients run, however fast the machine), until the clients are done."""
        kinds = list(self.plan.infra_faults)
        every = self.plan.infra_every_turns
        due, index = self._rng.randint(1, every), 0
        while kinds:
            async with self._progress:
                await self._progress.wait_for(lambda: self.report.committed >= due or self._clients_done.is_set())
            if self._clients_done.is_set():
                return
            kind = kinds[index % len(kinds)]
            index += 1
            due = self.report.committed + self._rng.randint(every // 2 + 1, every + every // 2)
            if kind is Fault.KILL_WORKER:
                owner = await self._some_owner(ids)
                if owner is None:
                    continue
                await self.infra.kill_worker(owner)
            elif kind is Fault.RESTART_SERVICE:
                await self.infra.restart_service()
            else:
                await self.infra.pause_redis(self.plan.redis_pause_s)
            self.report.faults[kind] += 1

    async def _some_owner(self, ids: list[str]) -> str | None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=30) as http:
            for conv_id in self._rng.sample(ids, len(ids)):
                r = await http.get(f"/v1/conversations/{conv_id}", params={"cache_salt": self.salt})
                if r.status_code == 200 and r.json()["head"]["owner"]:
                    return r.json()["head"]["owner"]
        return None

    # -- the property ------------------------------------------------------------------------
    async def _check(self, client: openai.AsyncOpenAI, ids: list[str]) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as http:
            for conv_id in ids:
                await self._check_ledger(http, conv_id)
        for conv_id in ids:
            await self._check_replay(client, conv_id)

    async def _check_ledger(self, http: httpx.AsyncClient, conv_id: str) -> None:
        recorded = self.recorded[conv_id]
        r = await http.get(f"/v1/conversations/{conv_id}", params={"cache_salt": self.salt})
        if r.status_code == 404 and not recorded:
            return
        if r.status_code != 200:
            self.report.divergences.append(f"{conv_id}: ledger unreadable: {r.status_code} {r.text[:200]}")
            return
        held = [(t["messages"][0]["content"], t["messages"][-1]["content"]) for t in r.json()["turns"]]
        told = [(t.user, t.reply) for t in recorded]
        if held != told:
            self.report.divergences.append(f"{conv_id}: ledger {held} != told {told}")
        turns = [t.turn for t in recorded]
        if turns != list(range(1, len(recorded) + 1)):
            self.report.divergences.append(f"{conv_id}: turn numbers told {turns}")

    async def _check_replay(self, client: openai.AsyncOpenAI, conv_id: str) -> None:
        history: list[dict] = []
        for t in self.recorded[conv_id]:
            history.append({"role": "user", "content": t.user})
            r = await client.chat.completions.create(model=self.model, messages=history,
                                                     max_tokens=self.plan.max_tokens, temperature=0)
            if r.choices[0].message.content != t.reply:
                self.report.divergences.append(
                    f"{conv_id} turn {t.turn}: served {t.reply!r}, replay {r.choices[0].message.content!r}")
            history.append({"role": "assistant", "content": t.reply})
        # The head the service names serves a next turn (attached or recovered), exactly.
        if self.recorded[conv_id]:
            extra = {"role": "user", "content": "one more"}
            nxt = await client.chat.completions.create(
                model=self.model, messages=[extra], max_tokens=self.plan.max_tokens, temperature=0,
                extra_body={"conversation_id": conv_id, "cache_salt": self.salt, "wait_if_busy": True})
            ref = await client.chat.completions.create(model=self.model, messages=history + [extra],
                                                       max_tokens=self.plan.max_tokens, temperature=0)
            if nxt.choices[0].message.content != ref.choices[0].message.content:
                self.report.divergences.append(f"{conv_id}: next turn after the run differs from a replay")
