"""A chaos client of an explicit chat conversation (`conversation_id`): turn after turn, each
with its own Idempotency-Key, retried until it is told success; some turns with a stop string.

Its checks: the conversation's items (what clients were told) == the turns it was told, in
order, none twice; a sample of turns (every one cut by a hang-up or sent with a stop string)
replayed by key == the live answer (text, finish reason, usage, turn); each reply == a
fault-free stateless replay of the model's side of the history; the head serves a next turn.
A conversation idle past the TTL must be a 404 and then start again at turn 1.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field

import httpx
import openai

from bench.chaos.plan import ClientKind, Fault
from bench.chaos.session import ClientGone, Session


@dataclass(frozen=True)
class Answer:
    """What one live answer sent."""

    text: str
    finish: str | None
    usage: dict | None
    turn: int | None


@dataclass
class ChatTurn:
    user: str
    stop: list[str] | None
    key: str
    answer: Answer
    sent_at: float                                  # when the committed attempt was sent
    cuts: list[str] = field(default_factory=list)   # what attempts that hung up had been sent
    model_side: str | None = None                   # the ledger's reply (before any stop cut)


class ChatClient:
    kind = ClientKind.CHAT

    def __init__(self, session: Session, index: int, conv_id: str):
        self.s, self.index, self.conv_id = session, index, conv_id
        self.epochs: list[list[ChatTurn]] = [[]]  # a new one after each expiry

    async def run(self) -> None:
        plan, s = self.s.plan, self.s
        # Per-turn choices from one generator, per-attempt rolls from another: the turns a seed
        # plans (forks, deletes, expiries, stops) do not depend on how many attempts faults cost.
        rng, attempts_rng = random.Random(f"{plan.seed}:{self.index}"), random.Random(f"{plan.seed}:{self.index}:a")
        for turn in range(1, plan.turns + 1):
            epoch = self.epochs[-1]
            expire, stopped, replayed = (rng.random() < rate for rate in (plan.expiry_rate, plan.stop_rate,
                                                                          plan.replay_rate))
            if epoch and plan.conversation_ttl_s and expire:
                await self._check_ledger(epoch)
                await s.idle_past_ttl()
                s.report.faults[Fault.TTL_EXPIRY] += 1
                r = await s.read("GET", f"/v1/conversations/{self.conv_id}")
                if r.status_code != 404:
                    s.diverged(f"{self.conv_id}: idle past its TTL, GET answered {r.status_code}")
                s.report.expiries += 1
                self.epochs.append([])
                epoch = self.epochs[-1]
            text = f"conversation {self.index} turn {turn}: {rng.randrange(10**6)}"
            stop = [rng.choice("aeiost ")] if stopped else None
            told = await self._until_told(text, stop, uuid.uuid4().hex, attempts_rng)
            if told is None:
                s.diverged(f"{self.conv_id}: turn {turn} never succeeded in {plan.max_attempts} attempts")
                return
            if told.answer.turn != len(epoch) + 1:
                if told.answer.turn == 1 and epoch and s.may_have_expired(epoch[-1].sent_at):
                    s.report.expiries += 1  # expired while its client retried: a new conversation, cleanly
                    self.epochs.append([])
                    epoch = self.epochs[-1]
                else:
                    s.diverged(f"{self.conv_id}: told turn {told.answer.turn}, expected {len(epoch) + 1}")
            epoch.append(told)
            await s.committed(self.kind)
            if told.cuts or stop or replayed:
                await self._replay(told)
        await self._check_ledger(self.epochs[-1])
        await self._check_next_turn(self.epochs[-1])

    def _body(self, user: str, stop: list[str] | None) -> dict:
        return {"model": self.s.model, "messages": [{"role": "user", "content": user}],
                "max_tokens": self.s.plan.max_tokens, "temperature": 0, "stop": stop,
                "extra_body": {"conversation_id": self.conv_id, "cache_salt": self.s.salt, "wait_if_busy": True}}

    async def _until_told(self, user: str, stop: list[str] | None, key: str, rng: random.Random) -> ChatTurn | None:
        cuts: list[str] = []
        for attempt in range(self.s.plan.max_attempts):
            await self.s.backoff(attempt)
            self.s.report.attempts += 1
            sent = time.monotonic()
            answer = await self._attempt(user, stop, key, rng, cuts)
            if answer is not None:
                return ChatTurn(user, stop, key, answer, sent, cuts)
        return None

    async def _attempt(self, user, stop, key, rng, cuts: list[str]) -> Answer | None:
        plan = self.s.plan
        roll = rng.random()
        if roll < plan.duplicate_rate:
            self.s.report.faults[Fault.DUPLICATE] += 1
            outcomes = await asyncio.gather(self._send(user, stop, key, cuts, hang_up=False),
                                            self._send(user, stop, key, cuts, hang_up=False))
            told = [o for o in outcomes if o is not None]
            if len(told) == 2 and told[0] != told[1]:
                self.s.diverged(f"{self.conv_id}: one key, two answers: {told}")
            return told[0] if told else None
        hang_up = roll < plan.duplicate_rate + plan.disconnect_rate
        if hang_up:
            self.s.report.faults[Fault.DISCONNECT] += 1
        return await self._send(user, stop, key, cuts, hang_up=hang_up)

    async def _send(self, user, stop, key, cuts: list[str], *, hang_up: bool) -> Answer | None:
        parts, turn, finish, usage = [], None, None, None
        try:
            stream = await self.s.openai.chat.completions.create(
                **self._body(user, stop), stream=True, stream_options={"include_usage": True},
                extra_headers={"Idempotency-Key": key})
            async with stream:
                async for chunk in stream:
                    for choice in chunk.choices:
                        parts.append(choice.delta.content or "")
                        finish = finish or choice.finish_reason
                    usage = chunk.usage.model_dump() if chunk.usage else usage
                    turn = (chunk.model_extra or {}).get("turn", turn)
                    if hang_up and "".join(parts):
                        cuts.append("".join(parts))
                        raise ClientGone
            if finish is None or turn is None:
                raise openai.APIError("the stream ended without a finished turn", request=None, body=None)
            return Answer("".join(parts), finish, usage, turn)
        except ClientGone:
            return None
        except (openai.APIError, httpx.HTTPError) as e:
            self.s.told_error(e)
            return None

    async def _replay(self, told: ChatTurn) -> None:
        """The same request with the same key, not streamed: the ledger's answer, which must be
        byte for byte what the live answer sent."""
        for attempt in range(self.s.plan.max_attempts):
            await self.s.backoff(attempt)
            try:
                r = await self.s.openai.chat.completions.create(
                    **self._body(told.user, told.stop), extra_headers={"Idempotency-Key": told.key})
            except (openai.APIError, httpx.HTTPError) as e:
                if isinstance(e, openai.APIStatusError) and e.status_code < 500 and e.status_code != 409:
                    self.s.diverged(f"{self.conv_id} turn {told.answer.turn}: replay refused: {e}")
                    return
                continue
            choice = r.choices[0]
            usage = r.usage.model_dump() if r.usage else None
            replay = Answer(choice.message.content or "", choice.finish_reason, usage, (r.model_extra or {}).get("turn"))
            self.s.report.replays += 1
            if replay != told.answer:
                self.s.diverged(f"{self.conv_id} turn {told.answer.turn}: live {told.answer}, replay {replay}")
            for cut in told.cuts:
                if not replay.text.startswith(cut):
                    self.s.diverged(f"{self.conv_id} turn {told.answer.turn}: a cut stream sent {cut!r}, "
                                    f"the turn is {replay.text!r}")
            return
        self.s.diverged(f"{self.conv_id} turn {told.answer.turn}: replay never answered")

    async def _check_ledger(self, epoch: list[ChatTurn]) -> None:
        """What the service holds, as clients were told it, == what this client was told; and
        the model's side of each reply kept for the stateless replay."""
        told = [m for t in epoch for m in (("user", t.user), ("assistant", t.answer.text))]
        held = await self.s.told_items(self.conv_id)
        if held is None and not epoch:
            return
        if held != told:
            self.s.diverged(f"{self.conv_id}: items {held} != told {told}")
            return
        r = await self.s.read("GET", f"/v1/conversations/{self.conv_id}")
        for t, ledger_turn in zip(epoch, r.json()["turns"]):
            t.model_side = ledger_turn["messages"][-1]["content"]

    async def _check_next_turn(self, epoch: list[ChatTurn]) -> None:
        """The head the service names serves a next turn (attached or recovered), exactly."""
        if not epoch or epoch[-1].model_side is None:
            return
        extra = {"role": "user", "content": "one more"}
        for attempt in range(self.s.plan.max_attempts):
            await self.s.backoff(attempt)
            try:
                nxt = await self.s.openai.chat.completions.create(
                    model=self.s.model, messages=[extra], max_tokens=self.s.plan.max_tokens, temperature=0,
                    extra_body={"conversation_id": self.conv_id, "cache_salt": self.s.salt, "wait_if_busy": True})
                break
            except (openai.APIError, httpx.HTTPError):
                continue
        else:
            self.s.diverged(f"{self.conv_id}: no next turn after the run")
            return
        ref = await self.s.openai.chat.completions.create(
            model=self.s.model, messages=_model_history(epoch) + [extra], max_tokens=self.s.plan.max_tokens,
            temperature=0)
        if nxt.choices[0].message.content != ref.choices[0].message.content:
            self.s.diverged(f"{self.conv_id}: next turn after the run differs from a replay")

    async def check_exact(self) -> None:
        """Each reply == a fault-free stateless replay of the history the model saw (the ledger's
        side of each reply); where that side is unknown (an epoch that expired unchecked), up to
        the first turn whose stop string may have cut its reply."""
        for epoch in self.epochs:
            history: list[dict] = []
            for t in epoch:
                history.append({"role": "user", "content": t.user})
                r = await self.s.openai.chat.completions.create(model=self.s.model, messages=history, stop=t.stop,
                                                                max_tokens=self.s.plan.max_tokens, temperature=0)
                if r.choices[0].message.content != t.answer.text:
                    self.s.diverged(f"{self.conv_id} turn {t.answer.turn}: served {t.answer.text!r}, "
                                    f"replay {r.choices[0].message.content!r}")
                side = t.model_side if t.model_side is not None else t.answer.text if t.stop is None else None
                if side is None:
                    break
                history.append({"role": "assistant", "content": side})


def _model_history(epoch: list[ChatTurn]) -> list[dict]:
    return [m for t in epoch for m in ({"role": "user", "content": t.user},
                                       {"role": "assistant", "content": t.model_side})]
