"""The HTTP side of `bench.serve`: server processes, and conversations driven with `openai`.

A server is a subprocess in its own process group, on 127.0.0.1, ready when its health URL
answers 200; stopping it signals the whole group (SIGINT, then SIGKILL after a grace period)
so nothing it started outlives the benchmark. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import httpx
import openai


def await_tier_export(base_url: str, conversation_id: str, cache_salt: str, timeout_s: float) -> float | None:
    """Seconds until the conversation's head is in the state tier (its tier_version reached its
    version: the worker's asynchronous export is done), None if not within timeout_s."""
    t0 = time.perf_counter()
    with httpx.Client(base_url=base_url, timeout=10) as client:
        while time.perf_counter() - t0 < timeout_s:
            head = client.get(f"/v1/conversations/{conversation_id}", params={"cache_salt": cache_salt}).json()["head"]
            if head["tier_version"] >= head["version"]:
                return time.perf_counter() - t0
            time.sleep(0.1)
    return None


# -- the workload ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Script:
    """One conversation: a system prompt, user turns, and each turn's max_tokens."""

    system: str
    users: tuple[str, ...]
    replies: tuple[int, ...]


@dataclass
class TurnRecord:
    conversation: int
    turn: int  # 1-based
    conversation_id: str = ""
    ttft_s: float | None = None
    total_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not report it
    completion_tokens: int | None = None
    error: str | None = None


@dataclass
class WorkloadResult:
    records: list[TurnRecord]
    wall_s: float
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"wall_s": self.wall_s, "errors": self.errors, "records": [asdict(r) for r in self.records]}


class ConversationMode(str, enum.Enum):
    """How a turn is sent: only the new message of a stored conversation, or the full history."""

    STORED = "stored"  # conversation_id + cache_salt, suffix only (our app, conversation cache)
    STATELESS = "stateless"  # the whole history every turn, no extra field (vLLM)
    # Our app reuses the longest prefix held under a stateless request's cache_salt:
    SALTED = "salted"  # the whole history, one cache_salt per workload: prefixes reused
    FRESH_SALT = "fresh_salt"  # the whole history, a cache_salt of its own per request: nothing held matches


async def stream_turn(client: openai.AsyncOpenAI, model: str, messages: list[dict], max_tokens: int,
                      extra: dict | None, rec: TurnRecord) -> str:
    """One streamed chat completion; fills rec's timings and usage, returns the reply text."""
    t0 = time.perf_counter()
    text = []
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra or None)
    async for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            if rec.ttft_s is None:
                rec.ttft_s = time.perf_counter() - t0
            text.append(delta)
        if chunk.usage is not None:
            rec.prompt_tokens = chunk.usage.prompt_tokens
            rec.completion_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            rec.cached_tokens = details.cached_tokens if details is not None else None
    rec.total_s = time.perf_counter() - t0
    return "".join(text)


class Chat:
    """One client's conversation: its history so far, and how it sends a turn."""

    def __init__(self, index: int, script: Script, mode: ConversationMode, tag: str):
        self.index, self.script, self.mode, self.tag = index, script, mode, tag
        self.conversation_id = f"bench-{tag}-{index}-{uuid.uuid4().hex[:8]}"
        self.history: list[dict] = [{"role": "system", "content": script.system}]

    def request(self, turn: int) -> tuple[list[dict], dict | None]:
        """The messages and the extra body of turn `turn` (its user message already in history)."""
        if self.mode is ConversationMode.STORED:
            new = self.history[:1] + self.history[-1:] if turn == 1 else self.history[-1:]
            return new, {"conversation_id": self.conversation_id, "cache_salt": "bench"}
        if self.mode is ConversationMode.SALTED:
            return self.history, {"cache_salt": f"bench-{self.tag}"}
        if self.mode is ConversationMode.FRESH_SALT:
            return self.history, {"cache_salt": f"bench-{self.tag}-{uuid.uuid4().hex}"}
        return self.history, None

    async def send(self, client: openai.AsyncOpenAI, model: str, turn: int, records: list[TurnRecord]) -> bool:
        """Turn `turn` (1-based); its record is appended as it starts, so a workload cut off by its
        time budget keeps what was measured. False: the turn failed, the conversation ends (its
        history is now unknown)."""
        rec = TurnRecord(conversation=self.index, turn=turn, conversation_id=self.conversation_id)
        records.append(rec)
        self.history.append({"role": "user", "content": self.script.users[turn - 1]})
        messages, extra = self.request(turn)
        try:
            reply = await stream_turn(client, model, messages, self.script.replies[turn - 1], extra, rec)
        except openai.APIError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
            return False
        self.history.append({"role": "assistant", "content": reply})
        return True


async def run_conversation(client: openai.AsyncOpenAI, model: str, chat: Chat, records: list[TurnRecord]) -> None:
    for turn in range(1, len(chat.script.users) + 1):
        if not await chat.send(client, model, turn, records):
            return


async def run_rounds(client: openai.AsyncOpenAI, model: str, chats: list[Chat], records: list[TurnRecord]) -> None:
    """A round barrier: every conversation finishes turn t before any starts turn t + 1."""
    turns = max(len(c.script.users) for c in chats)
    live = list(chats)
    for turn in range(1, turns + 1):
        live = [c for c in live if turn <= len(c.script.users)]
        done = await asyncio.gather(*(c.send(client, model, turn, records) for c in live))
        live = [c for c, ok in zip(live, done) if ok]


async def run_pool(client: openai.AsyncOpenAI, model: str, chats: list[Chat], records: list[TurnRecord],
                   concurrency: int) -> None:
    """At most `concurrency` conversations at once, each started when one before it ends."""
    gate = asyncio.Semaphore(concurrency)

    async def one(chat: Chat) -> None:
        async with gate:
            await run_conversation(client, model, chat, records)

    await asyncio.gather(*(one(c) for c in chats))


class Schedule(str, enum.Enum):
    FREE = "free"  # every conversation at once, each at its own pace
    ROUNDS = "rounds"  # every conversation at once, a barrier after each turn
    POOL = "pool"  # `concurrency` conversations at a time, in order


async def drive_workload(base_url: str, request_timeout_s: float, budget_s: float,
                         work: Callable[[openai.AsyncOpenAI, str, list], Awaitable],
                         names: tuple[str, str] = ("conversation", "turn")) -> WorkloadResult:
    """`work(client, model, records)` against the server, within budget_s in all; what is still
    running then is cut off. `names`: what a record's conversation and turn are called."""
    whole, part = names
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=request_timeout_s)
    records: list = []
    errors: list[str] = []
    try:
        try:
            model = (await client.models.list()).data[0].id
        except openai.APIError as exc:  # e.g. a server that died in an earlier mode: a result, not a crash
            return WorkloadResult([], 0.0, [f"the server did not answer /v1/models: {type(exc).__name__}: {exc}"[:500]])
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(work(client, model, records), budget_s)
        except asyncio.TimeoutError:
            errors.append(f"time budget of {budget_s:.0f} s used up; unfinished {part}s are not counted")
            for rec in records:
                if rec.total_s is None and rec.error is None:
                    rec.error = "cut off by the time budget"
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    records.sort(key=lambda r: (r.conversation, r.turn))
    errors += [f"{whole} {r.conversation} {part} {r.turn}: {r.error}" for r in records if r.error]
    return WorkloadResult(records, wall, errors)


async def run_workload(base_url: str, scripts: list[Script], mode: ConversationMode, tag: str,
                       request_timeout_s: float, budget_s: float, schedule: Schedule = Schedule.FREE,
                       concurrency: int = 1) -> WorkloadResult:
    """The conversations as `schedule` orders them, within budget_s in all."""
    chats = [Chat(i, s, mode, tag) for i, s in enumerate(scripts)]

    def work(client: openai.AsyncOpenAI, model: str, records: list[TurnRecord]) -> Awaitable:
        if schedule is Schedule.ROUNDS:
            return run_rounds(client, model, chats, records)
        if schedule is Schedule.POOL:
            return run_pool(client, model, chats, records, concurrency)
        return asyncio.gather(*(run_conversation(client, model, c, records) for c in chats))

    return await drive_workload(base_url, request_timeout_s, budget_s, work)
