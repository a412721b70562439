"""Helpers of the serving tests: one chat turn through the official client, and its reference."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import openai

from cache_service.client import CacheClient

MAX_TOKENS = 8


def user(text: str) -> dict:
    return {"role": "user", "content": text}


@dataclass
class Reply:
    text: str
    tokens: list[str]  # token strings from logprobs: the exact sampled tokens
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    turn: int | None
    logprobs: list[float]  # of the sampled tokens, exactly as served


async def chat_turn(client: openai.AsyncOpenAI, model: str, messages: list[dict], *, conversation_id: str | None,
                    cache_salt: str = "", stream: bool = False, max_tokens: int = MAX_TOKENS, temperature: float = 0,
                    headers: dict | None = None, **extra) -> Reply:
    body = {"cache_salt": cache_salt, **extra}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    kwargs = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=temperature, logprobs=True,
                  top_logprobs=0, extra_body=body, extra_headers=headers)
    if not stream:
        r = await client.chat.completions.create(**kwargs)
        details = r.usage.prompt_tokens_details
        content = r.choices[0].logprobs.content
        return Reply(r.choices[0].message.content, [t.token for t in content], r.choices[0].finish_reason,
                     r.usage.prompt_tokens, details.cached_tokens if details else 0, r.model_extra.get("turn"),
                     [t.logprob for t in content])
    chunks = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text, tokens, logprobs, finish, usage, turn = [], [], [], None, None, None
    async for chunk in chunks:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.logprobs and choice.logprobs.content:
                tokens += [t.token for t in choice.logprobs.content]
                logprobs += [t.logprob for t in choice.logprobs.content]
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
        turn = (chunk.model_extra or {}).get("turn", turn)
    details = usage.prompt_tokens_details
    return Reply("".join(text), tokens, finish, usage.prompt_tokens, details.cached_tokens if details else 0, turn,
                 logprobs)


async def stateless_reference(client: openai.AsyncOpenAI, model: str, history: list[dict], **kw) -> Reply:
    """The history computed from scratch: a stateless request under a salt of its own (a scope no
    held prefix belongs to), unless the caller gives one."""
    kw.setdefault("cache_salt", f"reference-{uuid.uuid4().hex}")
    return await chat_turn(client, model, history, conversation_id=None, **kw)


async def conversation(http, conv_id: str, salt: str, *, prefix: str = "", headers: dict | None = None) -> dict:
    response = await http.get(f"{prefix}/v1/conversations/{conv_id}", params={"cache_salt": salt}, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


async def metric(http, name: str, *, prefix: str = "") -> float:
    text = (await http.get(f"{prefix}/metrics")).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} not exported"
    return values[0]


async def tier_copy(http, conv_id: str, salt: str, timeout_s: float = 30.0) -> dict:
    """The conversation once the state tier holds its head (an async export has nothing to await
    from outside the worker but the head's tier_version, so it is polled)."""
    async def poll() -> dict:
        while True:
            state = await conversation(http, conv_id, salt)
            if state["head"]["tier_version"] == state["head"]["version"]:
                return state
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), timeout_s)


async def prefix_holders(cache: CacheClient, scope: str, names: list[str], timeout_s: float = 30.0) -> tuple[str, ...]:
    """The replicas the prefix index names for the whole of `names` (announced after the answer,
    off the response path: polled)."""
    async def poll() -> tuple[str, ...]:
        while True:
            match = await cache.find_prefix(names, scope=scope)
            if match is not None and match.index == len(names) - 1:
                longest = max(tokens for _, tokens in match.holders)
                return tuple(replica for replica, tokens in match.holders if tokens == longest)
            await asyncio.sleep(0.1)

    return await asyncio.wait_for(poll(), timeout_s)
