"""A chaos client of the Responses API: a chain of stored responses, each continuing the latest
(`previous_response_id`), some forking from an older one, some after a DELETE of the latest
(its conversation rewound; the chain goes on from the response before it), each with its own
Idempotency-Key, streamed, with hang-ups and duplicates like the others.

Its checks: every conversation it leaves, and its last, lists as items exactly the path of
responses it was told leads there; `GET /v1/responses/{id}` of each is what it was told; a
deleted response is a 404; a sample of responses replayed by key == the live answer (id, text,
status, usage); a conversation idle past the TTL is a 404, and the chain starts again.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field

import httpx
import openai
from openai.types.responses import Response

from bench.chaos.plan import ClientKind, Fault
from bench.chaos.session import ClientGone, Session


@dataclass(frozen=True)
class Told:
    id: str
    conv: str
    text: str
    status: str
    usage: dict | None


@dataclass
class Node:
    user: str
    key: str
    told: Told
    parent: Node | None
    cuts: list[str] = field(default_factory=list)

    def path(self) -> list[Node]:
        node, path = self, []
        while node is not None:
            path.append(node)
            node = node.parent
        return path[::-1]


class ResponsesClient:
    kind = ClientKind.RESPONSES

    def __init__(self, session: Session, index: int, name: str):
        self.s, self.index, self.name = session, index, name
        self.head: Node | None = None
        # conversation -> the last response in it: after a DELETE rewinds the chain to a response of
        # another conversation (the deleted one was a fork), the head is no longer its conversation's end
        self.latest: dict[str, Node] = {}
        self.refreshed: dict[str, float] = {}  # conversation -> when its last turn (or rewind) was sent

    async def run(self) -> None:
        plan, s = self.s.plan, self.s
        # Per-turn choices from one generator, per-attempt rolls from another: the turns a seed
        # plans (forks, deletes, expiries, stops) do not depend on how many attempts faults cost.
        rng, attempts_rng = random.Random(f"{plan.seed}:{self.index}"), random.Random(f"{plan.seed}:{self.index}:a")
        for turn in range(1, plan.turns + 1):
            expire, delete, fork, replayed = (rng.random() < rate for rate in (
                plan.expiry_rate, plan.delete_rate, plan.fork_rate, plan.replay_rate))
            fork_from = rng.random()  # which older response, as a fraction of the path
            if self.head is not None and plan.conversation_ttl_s and expire:
                await self._expire()
            if self.head is not None and delete and self.latest.get(self.head.told.conv) is self.head:
                await self._delete_head()
            previous = self.head
            if previous is not None and len(previous.path()) >= 2 and fork:
                previous = previous.path()[int(fork_from * (len(previous.path()) - 1))]
            user = f"responses {self.index} turn {turn}: {rng.randrange(10**6)}"
            node = await self._until_told(user, previous, attempts_rng)
            if node is None:
                return
            if previous is not None and node.told.conv != previous.told.conv:
                s.report.forks += 1
            if self.head is not None and node.told.conv != self.head.told.conv:
                await self._check_conversation(self.head.told.conv, self._end_of(self.head.told.conv))  # left behind
            self.head = self.latest[node.told.conv] = node
            await s.committed(self.kind)
            if node.cuts or replayed:
                await self._replay(node)
        if self.head is not None:
            await self._check_conversation(self.head.told.conv, self._end_of(self.head.told.conv))

    def _end_of(self, conv: str) -> list[Node] | None:
        """The path of responses the client was told leads to the end of `conv` (None: it was emptied)."""
        end = self.latest.get(conv)
        return None if end is None else end.path()

    def _body(self, user: str, previous: Node | None) -> dict:
        body = {"model": self.s.model, "input": user, "max_output_tokens": self.s.plan.max_tokens, "temperature": 0,
                "extra_body": {"cache_salt": self.s.salt}}
        if previous is not None:
            body["previous_response_id"] = previous.told.id
        return body

    async def _until_told(self, user: str, previous: Node | None, rng: random.Random) -> Node | None:
        key, cuts = uuid.uuid4().hex, []
        for attempt in range(self.s.plan.max_attempts):
            await self.s.backoff(attempt)
            self.s.report.attempts += 1
            sent = time.monotonic()
            try:
                told = await self._attempt(user, previous, key, rng, cuts)
            except openai.NotFoundError:
                if previous is None or not self.s.may_have_expired(self.refreshed[previous.told.conv]):
                    self.s.diverged(f"{self.name}: {previous and previous.told.id} is a 404 before its TTL")
                    return None
                self.s.report.expiries += 1  # expired while its client retried: the chain starts again
                previous, self.head, key = None, None, uuid.uuid4().hex
                continue
            if told is not None:
                self.refreshed[told.conv] = sent
                return Node(user, key, told, previous, cuts)
        self.s.diverged(f"{self.name}: a response never succeeded in {self.s.plan.max_attempts} attempts")
        return None

    async def _attempt(self, user, previous, key, rng, cuts: list[str]) -> Told | None:
        plan = self.s.plan
        roll = rng.random()
        if roll < plan.duplicate_rate:
            self.s.report.faults[Fault.DUPLICATE] += 1
            outcomes = await asyncio.gather(self._send(user, previous, key, cuts, False),
                                            self._send(user, previous, key, cuts, False))
            told = [o for o in outcomes if o is not None]
            if len(told) == 2 and told[0] != told[1]:
                self.s.diverged(f"{self.name}: one key, two responses: {told}")
            return told[0] if told else None
        hang_up = roll < plan.duplicate_rate + plan.disconnect_rate
        if hang_up:
            self.s.report.faults[Fault.DISCONNECT] += 1
        return await self._send(user, previous, key, cuts, hang_up)

    async def _send(self, user, previous, key, cuts: list[str], hang_up: bool) -> Told | None:
        parts, final = [], None
        try:
            stream = await self.s.openai.responses.create(**self._body(user, previous), stream=True,
                                                          extra_headers={"Idempotency-Key": key})
            async with stream:
                async for event in stream:
                    if event.type == "response.output_text.delta":
                        parts.append(event.delta)
                        if hang_up:
                            cuts.append("".join(parts))
                            raise ClientGone
                    elif event.type in ("response.completed", "response.incomplete"):
                        final = event.response
            if final is None:
                raise openai.APIError("the stream ended without a final response", request=None, body=None)
            if final.output_text != "".join(parts):
                self.s.diverged(f"{self.name}: streamed {''.join(parts)!r}, final response {final.output_text!r}")
            return _told(final.model_dump())
        except ClientGone:
            return None
        except openai.NotFoundError:
            raise
        except (openai.APIError, httpx.HTTPError) as e:
            self.s.told_error(e)
            return None

    async def _replay(self, node: Node) -> None:
        for attempt in range(self.s.plan.max_attempts):
            await self.s.backoff(attempt)
            try:
                r = await self.s.openai.responses.create(**self._body(node.user, node.parent),
                                                         extra_headers={"Idempotency-Key": node.key})
            except (openai.APIError, httpx.HTTPError) as e:
                if isinstance(e, openai.APIStatusError) and e.status_code < 500 and e.status_code != 409:
                    self.s.diverged(f"{self.name} {node.told.id}: replay refused: {e}")
                    return
                continue
            replay = _told(r.model_dump())
            self.s.report.replays += 1
            if replay != node.told:
                self.s.diverged(f"{self.name}: live {node.told}, replay {replay}")
            for cut in node.cuts:
                if not replay.text.startswith(cut):
                    self.s.diverged(f"{self.name} {node.told.id}: a cut stream sent {cut!r}, told {replay.text!r}")
            return
        self.s.diverged(f"{self.name} {node.told.id}: replay never answered")

    async def _delete_head(self) -> None:
        head = self.head
        self.refreshed[head.told.conv] = time.monotonic()
        r = await self.s.read("DELETE", f"/v1/responses/{head.told.id}")
        if r.status_code not in (200, 404):  # 404: an earlier try that failed for the client did delete it
            self.s.diverged(f"{self.name}: DELETE {head.told.id}: {r.status_code} {r.text[:200]}")
            return
        self.s.report.deletes += 1
        gone = await self.s.read("GET", f"/v1/responses/{head.told.id}")
        if gone.status_code != 404:
            self.s.diverged(f"{self.name}: deleted {head.told.id}, GET answered {gone.status_code}")
        rewound = head.path()[:-1] if _turn(head) > 1 else None  # its first turn: the conversation is gone
        await self._check_conversation(head.told.conv, rewound)
        self.head = head.parent
        if head.parent is None:  # the conversation is gone
            self.latest.pop(head.told.conv, None)
        else:  # its end is the parent's path (for a fork's first response, the turns it copied)
            self.latest[head.told.conv] = head.parent

    async def _expire(self) -> None:
        head = self.head
        await self._check_conversation(head.told.conv, self._end_of(head.told.conv))
        await self.s.idle_past_ttl()
        self.s.report.faults[Fault.TTL_EXPIRY] += 1
        r = await self.s.read("GET", f"/v1/responses/{head.told.id}")
        if r.status_code != 404:
            self.s.diverged(f"{self.name}: idle past its TTL, GET {head.told.id} answered {r.status_code}")
        self.s.report.expiries += 1
        self.head = None

    async def _check_conversation(self, conv: str, path: list[Node] | None) -> None:
        """The conversation's items == the path of responses told to lead there (None: gone),
        and each of its own responses reads back as told. A conversation left behind may have
        been idle past its TTL by now (the next turn's retries can outlast it): gone is then
        what it was promised, not a divergence."""
        held = await self.s.told_items(conv)
        if held is None and path is not None and self._may_have_expired(conv):
            return
        told = None if path is None else [m for n in path for m in (("user", n.user), ("assistant", n.told.text))]
        if held != told:
            self.s.diverged(f"{self.name}: {conv} items {held} != told {told}")
        for node in path or []:
            if node.told.conv != conv:
                continue
            r = await self.s.read("GET", f"/v1/responses/{node.told.id}")
            if r.status_code == 404 and self._may_have_expired(conv):
                return
            held = _told(Response.model_validate(r.json()).model_dump()) if r.status_code == 200 else r.status_code
            if held != node.told:
                self.s.diverged(f"{self.name}: GET {node.told.id}: {held} != told {node.told}")

    def _may_have_expired(self, conv: str) -> bool:
        return conv in self.refreshed and self.s.may_have_expired(self.refreshed[conv])


def _turn(node: Node) -> int:
    return len(node.path())


def _told(response: dict) -> Told:
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    conv = (response.get("conversation") or {}).get("id")
    return Told(response["id"], conv, text, response["status"], response.get("usage"))
