"""The HTTP side of `bench.serve`: server processes, and conversations driven with `openai`.

A server is a subprocess in its own process group, on 127.0.0.1, ready when its health URL
answers 200; stopping it signals the whole group (SIGINT, then SIGKILL after a grace period)
so nothing it started outlives the benchmark. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path, health_url: str):
        self.name, self.argv, self.health_url, self.log_path = name, argv, health_url, log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.perf_counter()

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the health URL answered 200; raises if the process died or time ran out."""
        deadline = self.started + timeout_s
        with httpx.Client(timeout=5) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready "
                                       f"(log: {self.log_path})\n{self.tail()}")
                try:
                    if client.get(self.health_url).status_code == 200:
                        return time.perf_counter() - self.started
                except httpx.TransportError:
                    pass
                time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s (log: {self.log_path})\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 25) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def error_lines(self, limit: int = 30) -> list[str]:
        """The first lines that name an error: the root cause, before the cascade it sets off."""
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line[:400] for line in lines if "Error" in line and "EngineDeadError" not in line][:limit]

    def stop(self, grace_s: float = 60.0) -> None:
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; anything it left in its group goes too.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        self._log.close()


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


class ConversationMode:
    """How a turn is sent: only the new message of a stored conversation, or the full history."""

    STORED = "stored"  # conversation_id + cache_salt, suffix only (our app, cache on)
    STATELESS = "stateless"  # the whole history every turn (our app with the cache off; vLLM)


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


async def run_conversation(client: openai.AsyncOpenAI, model: str, index: int, script: Script, mode: str,
                           tag: str, records: list[TurnRecord]) -> None:
    """The conversation's turns in order; each turn's record is appended as it starts, so a
    workload cut off by its time budget keeps what was measured."""
    conversation_id = f"bench-{tag}-{index}-{uuid.uuid4().hex[:8]}"
    history: list[dict] = [{"role": "system", "content": script.system}]
    for turn, (user, max_tokens) in enumerate(zip(script.users, script.replies), start=1):
        rec = TurnRecord(conversation=index, turn=turn, conversation_id=conversation_id)
        records.append(rec)
        new = ([history[0]] if turn == 1 else []) + [{"role": "user", "content": user}]
        history.append(new[-1])
        if mode == ConversationMode.STORED:
            sent, extra = new, {"conversation_id": conversation_id, "cache_salt": "bench"}
        else:
            sent, extra = history, None
        try:
            reply = await stream_turn(client, model, sent, max_tokens, extra, rec)
        except openai.APIError as exc:
            # A server that fails a turn ends the conversation: its history is now unknown.
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
            return
        history.append({"role": "assistant", "content": reply})


async def run_workload(base_url: str, scripts: list[Script], mode: str, tag: str, request_timeout_s: float,
                       budget_s: float) -> WorkloadResult:
    """All conversations at once, each one's turns in order, within budget_s in all."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=request_timeout_s)
    records: list[TurnRecord] = []
    errors = []
    try:
        try:
            model = (await client.models.list()).data[0].id
        except openai.APIError as exc:  # e.g. a server that died in an earlier mode: a result, not a crash
            return WorkloadResult([], 0.0, [f"the server did not answer /v1/models: {type(exc).__name__}: {exc}"[:500]])
        t0 = time.perf_counter()
        runs = [run_conversation(client, model, i, s, mode, tag, records) for i, s in enumerate(scripts)]
        try:
            await asyncio.wait_for(asyncio.gather(*runs), budget_s)
        except asyncio.TimeoutError:
            errors.append(f"time budget of {budget_s:.0f} s used up; unfinished turns are not counted")
            for rec in records:
                if rec.total_s is None and rec.error is None:
                    rec.error = "cut off by the time budget"
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    records.sort(key=lambda r: (r.conversation, r.turn))
    errors += [f"conversation {r.conversation} turn {r.turn}: {r.error}" for r in records if r.error]
    return WorkloadResult(records, wall, errors)
