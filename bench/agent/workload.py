"""The agent loops of `bench.agent`: a deterministic tool catalogue, seeded tool results, and a
client that runs forced-call steps against one side.

A loop's step sends the history (or, with a stored conversation, only what is new) with
`tool_choice="required"`, `parallel_tool_calls=False`, greedy, streamed with usage; the reply's
single call is appended as the assistant message, then the tool's result (`role: tool`,
`tool_call_id`), and the next step goes on. vLLM is sent the same prompts as token ids: our
chat template rendered here, with the calls our app made at that step (see `PromptRenderer`).
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import openai

from bench.kit.chat_client import TurnRecord, WorkloadResult, drive_workload
from bench.kit.chat_text import chat_text

# Argument schemas are bounded (maxLength, integer ranges, enums, no extra properties), so a
# forced call always ends within a step's max_tokens.
_NOUNS = ("order", "invoice", "ticket", "user", "report", "shipment", "refund", "booking", "file", "alert",
          "device", "account", "payment", "product", "review", "session", "backup", "policy", "metric", "job")
_VERBS = ("get", "list", "create", "update", "cancel", "search", "export", "check", "assign", "close")


def make_catalogue(count: int, seed: int) -> list[dict]:
    """`count` function tools with JSON-schema parameters, the same for every seed's run."""
    rng = random.Random(seed)
    tools, names = [], set()
    while len(tools) < count:
        name = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
        if name in names:
            name = f"{name}_{len(tools)}"
        names.add(name)
        props: dict = {"id": {"type": "string", "maxLength": 12, "description": f"The {name.split('_')[1]} id"}}
        if rng.random() < 0.7:
            props["limit"] = {"type": "integer", "minimum": 1, "maximum": 50, "description": "At most this many"}
        if rng.random() < 0.6:
            props["status"] = {"enum": rng.sample(["open", "closed", "pending", "failed", "done"], 3)}
        if rng.random() < 0.4:
            props["urgent"] = {"type": "boolean"}
        tools.append({"type": "function", "function": {
            "name": name,
            "description": chat_text(rng, rng.randint(30, 70), f"Tool {len(tools)}:"),
            "parameters": {"type": "object", "properties": props, "required": sorted(props)[:2],
                           "additionalProperties": False}}})
    return tools


class PromptRenderer:
    """The checkpoint's tokenizer and chat template, as the app renders prompts (token ids)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def catalogue_tokens(self, tools: list[dict], system: str) -> int:
        """Tokens the catalogue adds to a chat's prompt (tools block and its instructions)."""
        chat = [{"role": "system", "content": system}, {"role": "user", "content": "go"}]
        return len(self.ids(chat, tools)) - len(self.ids(chat, None))


def sized_catalogue(renderer: PromptRenderer, target_tokens: int, seed: int) -> tuple[list[dict], int]:
    """The catalogue whose rendering adds the nearest to target_tokens: (tools, its tokens)."""
    best: tuple[int, list[dict], int] | None = None
    count, n = 0, 0
    while n < target_tokens:
        count += 1
        tools = make_catalogue(count, seed)
        n = renderer.catalogue_tokens(tools, "x")
        if best is None or abs(n - target_tokens) < best[0]:
            best = (abs(n - target_tokens), tools, n)
    return best[1], best[2]


@dataclass(frozen=True)
class LoopScript:
    tenant: int  # the loops of a tenant share its system prompt, its catalogue and its cache_salt
    system: str
    task: str
    results: tuple[str, ...]  # the tool's result after each step
    max_tokens: int
    think_s: tuple[float, ...] = ()  # the agent's pause before each step after the first


def make_loop_scripts(loops: int, steps: int, result_tokens: tuple[int, int], max_tokens: int, seed: int,
                      tenants: int = 1, think_s: tuple[float, float] = (0.0, 0.0)) -> list[LoopScript]:
    """Loop i belongs to tenant i % tenants: a deployment's tenants each run many loops at once,
    over one system prompt and catalogue (what they share), each loop with its own task."""
    rng = random.Random(seed + 31)
    return [LoopScript(tenant=i % tenants,
                       system=f"You are an agent of tenant #{i % tenants}. Use the tools to finish the task, "
                              "one call at a time.",
                       task=chat_text(rng, 120, f"Task {i}:"),
                       results=tuple(chat_text(rng, rng.randint(*result_tokens), f"Result {s + 1}:")
                                     for s in range(steps)),
                       max_tokens=max_tokens,
                       think_s=tuple(round(rng.uniform(*think_s), 3) for _ in range(steps - 1)))
            for i in range(loops)]


class Side(str, enum.Enum):
    EXPLICIT = "a"  # ours: conversation_id + the tenant's cache_salt, only the new messages each step
    STATELESS = "b"  # ours: the full history, the tenant's cache_salt (prefix reuse)
    RECOMPUTE = "c"  # ours: the full history, a fresh cache_salt per request (reuse off)
    VLLM_OFF = "d"  # vLLM's OpenAI server, --no-enable-prefix-caching
    VLLM_ON = "d_on"  # vLLM, prefix caching on (its default; expected to fail for hybrids on CPU)
    RESPONSES = "responses"  # ours, Responses API with previous_response_id (see send_responses_step)


@dataclass
class StepRecord(TurnRecord):
    """A step of a loop: `conversation` is the loop, `turn` the step (bench.serve's summary reads both)."""

    finish_reason: str | None = None
    calls: list[dict] = field(default_factory=list)  # [{"id", "name", "arguments"}]
    delta_at_s: list[float] | None = None  # when kept: each content / tool-call delta's arrival (perf_counter)
    served_by: dict | None = None  # our app's last chunk's "hybridserve": {replica, cached_from, recovery}


async def _stream_chat(client: openai.AsyncOpenAI, rec: StepRecord, **kwargs) -> None:
    """A streamed chat completion: TTFT at the first delta with content or tool calls."""
    t0 = time.perf_counter()
    calls: dict[int, dict] = {}
    stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content or delta.tool_calls:
                now = time.perf_counter()
                rec.ttft_s = now - t0 if rec.ttft_s is None else rec.ttft_s
                if rec.delta_at_s is not None:
                    rec.delta_at_s.append(now)
            for piece in delta.tool_calls or ():
                entry = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                if piece.id:
                    entry["id"], entry["name"] = piece.id, piece.function.name
                entry["arguments"] += piece.function.arguments or ""
            rec.finish_reason = choice.finish_reason or rec.finish_reason
        if chunk.usage is not None:
            _take_usage(rec, chunk.usage)
        rec.served_by = (chunk.model_extra or {}).get("hybridserve", rec.served_by)
    rec.total_s = time.perf_counter() - t0
    rec.calls = [c for _, c in sorted(calls.items())]


def _take_usage(rec: StepRecord, usage) -> None:
    rec.prompt_tokens, rec.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    details = usage.prompt_tokens_details
    rec.cached_tokens = details.cached_tokens if details is not None else None


async def _stream_completion(client: openai.AsyncOpenAI, rec: StepRecord, **kwargs) -> None:
    """A streamed (legacy) completion of token ids: TTFT at the first text."""
    t0 = time.perf_counter()
    stream = await client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.text and rec.ttft_s is None:
                rec.ttft_s = time.perf_counter() - t0
            rec.finish_reason = choice.finish_reason or rec.finish_reason
        if chunk.usage is not None:
            _take_usage(rec, chunk.usage)
    rec.total_s = time.perf_counter() - t0


def responses_tools(tools: list[dict]) -> list[dict]:
    """Chat's function tools in the Responses API's flat form."""
    return [{"type": "function", **t["function"]} for t in tools]


async def send_responses_step(client: openai.AsyncOpenAI, loop: "AgentLoop", rec: StepRecord, **common) -> None:
    """Side RESPONSES: the step as a streamed `POST /v1/responses`, the first with the system
    prompt as `instructions` and the task, each later one with only the tool's output and
    `previous_response_id` (the stored conversation continues). TTFT: the first event that
    names the call or carries text."""
    t0 = time.perf_counter()
    body = dict(model=common["model"], max_output_tokens=common["max_tokens"], temperature=0,
                tools=responses_tools(loop.tools), tool_choice="required", parallel_tool_calls=False, stream=True,
                extra_body={"cache_salt": loop.salt})
    if loop.response_id is None:
        body |= {"instructions": loop.script.system, "input": [{"role": "user", "content": loop.script.task}]}
    else:
        body |= {"previous_response_id": loop.response_id, "input": [
            {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]} for m in loop.new]}
    calls: list[dict] = []
    stream = await client.responses.create(**body)
    async for event in stream:
        kind = event.type
        if kind in ("response.output_item.added", "response.output_text.delta") and rec.ttft_s is None:
            rec.ttft_s = time.perf_counter() - t0
        if kind == "response.output_item.done" and event.item.type == "function_call":
            calls.append({"id": event.item.call_id, "name": event.item.name, "arguments": event.item.arguments})
        if kind in ("response.completed", "response.incomplete"):
            response = event.response
            loop.response_id = response.id
            usage = response.usage
            rec.prompt_tokens, rec.completion_tokens = usage.input_tokens, usage.output_tokens
            rec.cached_tokens = usage.input_tokens_details.cached_tokens
            rec.finish_reason = "tool_calls" if calls else response.status
            rec.served_by = (response.model_extra or {}).get("hybridserve", rec.served_by)
        if kind in ("error", "response.failed"):
            raise RuntimeError(f"the response failed: {event}")
    rec.total_s = time.perf_counter() - t0
    rec.calls = calls


class AgentLoop:
    """One agent's history, and how its steps are sent to one side."""

    def __init__(self, index: int, script: LoopScript, side: Side, tools: list[dict], tag: str, run_tag: str,
                 replay: dict[tuple[int, int], list[dict]] | None = None, renderer: PromptRenderer | None = None):
        self.index, self.script, self.side, self.tools, self.tag = index, script, side, tools, tag
        self.conversation_id = f"agent-{tag}-{index}-{uuid.uuid4().hex[:8]}"
        self.salt = f"agent-{tag}-tenant{script.tenant}-{run_tag}"  # the tenant's, on this side of this run
        self.history: list[dict] = [{"role": "system", "content": script.system},
                                    {"role": "user", "content": script.task}]
        self.new: list[dict] = list(self.history)  # what a stored conversation has not seen yet
        self.replay, self.renderer = replay or {}, renderer
        self.response_id: str | None = None  # for the Responses side

    async def send(self, client: openai.AsyncOpenAI, model: str, step: int, rec: StepRecord) -> None:
        common = dict(model=model, max_tokens=self.script.max_tokens, temperature=0)
        chat = dict(common, tools=self.tools, tool_choice="required", parallel_tool_calls=False)
        if self.side is Side.EXPLICIT:
            await _stream_chat(client, rec, messages=self.new, **chat,
                               extra_body={"conversation_id": self.conversation_id, "cache_salt": self.salt})
        elif self.side is Side.STATELESS:
            await _stream_chat(client, rec, messages=self.history, **chat, extra_body={"cache_salt": self.salt})
        elif self.side is Side.RECOMPUTE:
            await _stream_chat(client, rec, messages=self.history, **chat,
                               extra_body={"cache_salt": f"{self.salt}-{uuid.uuid4().hex}"})
        elif self.side is Side.RESPONSES:
            await send_responses_step(client, self, rec, **common)
        else:  # vLLM: the prompt our app saw, as token ids; as many tokens out as our app wrote
            done = self.replay.get((self.index, step))
            if done is None:
                raise RuntimeError(f"no reply of our app to replay at loop {self.index} step {step}")
            ids = self.renderer.ids(self.history, self.tools)
            await _stream_completion(client, rec, prompt=ids, **dict(common, max_tokens=done["completion_tokens"]),
                                     extra_body={"skip_special_tokens": False, "ignore_eos": True})
            rec.calls = done["calls"]

    def advance(self, step: int, calls: list[dict]) -> None:
        """The step's call and the tool's result join the history."""
        if not calls:
            raise RuntimeError("the reply made no tool call")
        call = calls[0]
        assistant = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]}
        result = {"role": "tool", "tool_call_id": call["id"], "content": self.script.results[step - 1]}
        self.history += [assistant, result]
        self.new = [result]

    async def run(self, client: openai.AsyncOpenAI, model: str, steps: int, records: list[StepRecord]) -> None:
        for step in range(1, steps + 1):
            if step > 1 and self.script.think_s:  # the agent acts on the tool's result
                await asyncio.sleep(self.script.think_s[step - 2])
            rec = StepRecord(conversation=self.index, turn=step, conversation_id=self.conversation_id)
            records.append(rec)
            try:
                await self.send(client, model, step, rec)
                self.advance(step, rec.calls)
            except (openai.APIError, RuntimeError, json.JSONDecodeError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"[:500]
                return


async def run_loops(base_url: str, loops: list[AgentLoop], steps: int, request_timeout_s: float,
                    budget_s: float) -> WorkloadResult:
    """Every loop at once, each at its own pace, within budget_s in all."""

    def work(client: openai.AsyncOpenAI, model: str, records: list[StepRecord]) -> Awaitable:
        return asyncio.gather(*(loop.run(client, model, steps, records) for loop in loops))

    return await drive_workload(base_url, request_timeout_s, budget_s, work, names=("loop", "step"))
