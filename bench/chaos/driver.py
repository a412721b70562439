"""The chaos property, checked against a running app: what every client was told is what the
service holds, and a replay equals the live answer.

    clients, turn after turn, retried until told success, of three kinds (bench/chaos/):
      chat.py       explicit conversations (conversation_id, Idempotency-Key, stop strings)
      responses.py  Responses API chains (previous_response_id, forks, DELETE of the latest)
      stateless.py  the whole history each turn, nothing stored
    client faults (seeded per attempt): hang up mid-stream, send the same attempt twice at once,
      stay idle past the conversation TTL
    injector (after seeded numbers of committed turns): worker SIGKILL, cache-service restart,
      Redis SIGSTOP past the client deadline, cache-service SIGSTOP under the lease TTL
    the stack: a state tier too small to hold the heads, so it spills all along

    per client (its module says how):
      what the service holds, as clients are told it == what this client was told   (integrity)
      a replay by Idempotency-Key == the live answer, byte for byte                  (replays)
      a conversation idle past its TTL is a 404, then a new conversation            (retention)
      every reply == a fault-free stateless replay (greedy)                          (exactness)

A divergence is any of these failing; the run reports them with the counts of turns attempted,
committed, failed-and-told, and faults by kind. The test (`tests/serve/test_chaos.py`) and the
benchmark (`python -m bench.chaos`) run this one driver on stacks of their own.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

from bench.chaos.chat import ChatClient
from bench.chaos.plan import ChaosPlan, ClientKind, Fault, Infrastructure, Report
from bench.chaos.responses import ResponsesClient
from bench.chaos.session import Session
from bench.chaos.stateless import StatelessClient

CLIENTS = {ClientKind.CHAT: ChatClient, ClientKind.RESPONSES: ResponsesClient, ClientKind.STATELESS: StatelessClient}


class ChaosRun:
    def __init__(self, plan: ChaosPlan, base_url: str, model: str, infra: Infrastructure):
        self.plan, self.infra = plan, infra
        self.session = Session(plan, base_url, model)
        self.report = self.session.report
        self._rng = random.Random(plan.seed)

    async def run(self) -> Report:
        started = time.monotonic()
        s = self.session
        clients = [CLIENTS[self.plan.kinds[i % len(self.plan.kinds)]](
            s, i, f"chaos-{self.plan.seed}-{i}-{uuid.uuid4().hex[:6]}") for i in range(self.plan.conversations)]
        spills_before = await self.infra.tier_spills()
        injector = asyncio.create_task(self._inject(clients))
        try:
            await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), self.plan.budget_s)
        finally:
            async with s.progress:
                s.clients_done.set()
                s.progress.notify_all()
            await injector
        await self.infra.settled()
        self.report.faults[Fault.TIER_SPILL] += await self.infra.tier_spills() - spills_before
        for client in clients:
            if hasattr(client, "check_exact"):
                await client.check_exact()
        await s.close()
        self.report.wall_s = time.monotonic() - started
        return self.report

    async def _inject(self, clients: list) -> None:
        """Infrastructure faults in turn, each after a seeded number of committed turns (so every
        kind happens while clients run, however fast the machine), until the clients are done."""
        s, kinds, every = self.session, list(self.plan.infra_faults), self.plan.infra_every_turns
        due, index = self._rng.randint(1, every), 0
        while kinds:
            async with s.progress:
                await s.progress.wait_for(lambda: self.report.committed >= due or s.clients_done.is_set())
            if s.clients_done.is_set():
                return
            kind = kinds[index % len(kinds)]
            index += 1
            due = self.report.committed + self._rng.randint(every // 2 + 1, every + every // 2)
            if kind is Fault.KILL_WORKER:
                owner = await self._some_owner([c.conv_id for c in clients if isinstance(c, ChatClient)])
                if owner is None or not await self.infra.kill_worker(owner):
                    continue
            elif kind is Fault.RESTART_SERVICE:
                await self.infra.restart_service()
            elif kind is Fault.PAUSE_REDIS:
                await self.infra.pause_redis(self.plan.redis_pause_s)
            else:
                await self.infra.pause_service(self.plan.service_pause_s)
            self.report.faults[kind] += 1

    async def _some_owner(self, ids: list[str]) -> str | None:
        for conv_id in self._rng.sample(ids, len(ids)):
            r = await self.session.read("GET", f"/v1/conversations/{conv_id}")
            if r.status_code == 200 and r.json()["head"]["owner"]:
                return r.json()["head"]["owner"]
        return None
