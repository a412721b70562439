"""A stateless chaos client: no conversation id, the whole history sent with every turn (as the
Agents SDK and many frameworks do), streamed, with hang-ups and duplicates like the others.

Nothing is stored, so there is no ledger and no Idempotency-Key replay: what it was told must
equal a fault-free replay of the same request (text and finish reason, greedy), and the two
copies of a duplicated attempt must agree."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai

from bench.chaos.plan import ClientKind, Fault
from bench.chaos.session import ClientGone, Session


class StatelessClient:
    kind = ClientKind.STATELESS

    def __init__(self, session: Session, index: int, name: str):
        self.s, self.index, self.name = session, index, name
        self.told: list[tuple[list[dict], str, str]] = []  # (messages sent, reply, finish reason)

    async def run(self) -> None:
        plan, s = self.s.plan, self.s
        # Per-turn choices from one generator, per-attempt rolls from another: the turns a seed
        # plans (forks, deletes, expiries, stops) do not depend on how many attempts faults cost.
        rng, attempts_rng = random.Random(f"{plan.seed}:{self.index}"), random.Random(f"{plan.seed}:{self.index}:a")
        history: list[dict] = []
        for turn in range(1, plan.turns + 1):
            messages = history + [{"role": "user", "content": f"stateless {self.index} turn {turn}: "
                                                              f"{rng.randrange(10**6)}"}]
            for attempt in range(plan.max_attempts):
                await s.backoff(attempt)
                s.report.attempts += 1
                answer = await self._attempt(messages, attempts_rng)
                if answer is not None:
                    break
            else:
                s.diverged(f"{self.name}: turn {turn} never succeeded in {plan.max_attempts} attempts")
                return
            self.told.append((messages, *answer))
            history = messages + [{"role": "assistant", "content": answer[0]}]
            await s.committed(self.kind)

    async def _attempt(self, messages: list[dict], rng: random.Random) -> tuple[str, str] | None:
        roll = rng.random()
        if roll < self.s.plan.duplicate_rate:
            self.s.report.faults[Fault.DUPLICATE] += 1
            outcomes = await asyncio.gather(self._send(messages, False), self._send(messages, False))
            told = [o for o in outcomes if o is not None]
            if len(told) == 2 and told[0] != told[1]:
                self.s.diverged(f"{self.name}: one request, two answers: {told}")
            return told[0] if told else None
        hang_up = roll < self.s.plan.duplicate_rate + self.s.plan.disconnect_rate
        if hang_up:
            self.s.report.faults[Fault.DISCONNECT] += 1
        return await self._send(messages, hang_up)

    async def _send(self, messages: list[dict], hang_up: bool) -> tuple[str, str] | None:
        parts, finish = [], None
        try:
            stream = await self.s.openai.chat.completions.create(
                model=self.s.model, messages=messages, max_tokens=self.s.plan.max_tokens, temperature=0,
                stream=True, extra_body={"cache_salt": self.s.salt})
            async with stream:
                async for chunk in stream:
                    for choice in chunk.choices:
                        parts.append(choice.delta.content or "")
                        finish = finish or choice.finish_reason
                    if hang_up and "".join(parts):
                        raise ClientGone
            if finish is None:
                raise openai.APIError("the stream ended without a finish reason", request=None, body=None)
            return "".join(parts), finish
        except ClientGone:
            return None
        except (openai.APIError, httpx.HTTPError) as e:
            self.s.told_error(e)
            return None

    async def check_exact(self) -> None:
        for messages, reply, finish in self.told:
            r = await self.s.openai.chat.completions.create(model=self.s.model, messages=messages,
                                                            max_tokens=self.s.plan.max_tokens, temperature=0)
            replay = (r.choices[0].message.content or "", r.choices[0].finish_reason)
            if replay != (reply, finish):
                self.s.diverged(f"{self.name} turn {len(messages) // 2 + 1}: told {(reply, finish)}, replay {replay}")
