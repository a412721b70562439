"""Tool calling and structured outputs through the real app and the official client: forced
calls whose arguments validate (streamed and not), an agent loop whose every step after the
first is served from cache with the tokens of a from-scratch replay, JSON-schema replies of
the random-weight model that validate, a deterministic constrained reply that keeps its bits
under load, and the combinations this server refuses."""

from __future__ import annotations

import asyncio
import json
import uuid

import jsonschema
import pytest

from tests.grammar.schemas import random_schema
from tests.serve.helpers import metric, user

pytestmark = pytest.mark.timeout(300)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                        "unit": {"enum": ["c", "f"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _salt() -> str:
    return f"tools-{uuid.uuid4().hex[:8]}"


def _check_calls(calls) -> list[tuple[str, str]]:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in calls]


async def _streamed_calls(stream) -> tuple[str, list[tuple[str, str, str]], str]:
    content, calls, finish = "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or ():
                entry = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                if piece.id:
                    assert not entry["id"], "a call is named once"
                    entry["id"], entry["name"] = piece.id, piece.function.name
                entry["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


async def test_required_tool_calls_validate_streamed_and_not(stack):
    client = stack.client()
    kwargs = dict(model=stack.model, messages=[user("What's the weather in Paris, and 2 + 3?")], tools=TOOLS,
                  tool_choice="required", temperature=0, max_tokens=1500, extra_body={"cache_salt": _salt()})
    r = await client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    whole = _check_calls(choice.message.tool_calls)
    content, streamed, finish = await _streamed_calls(await client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(name, args) for _, name, args in streamed] == whole  # same greedy reply, in pieces
    named = await client.chat.completions.create(**{**kwargs, "tool_choice": {"type": "function",
                                                                                "function": {"name": "add"}},
                                                    "parallel_tool_calls": False})
    assert [name for name, _ in _check_calls(named.choices[0].message.tool_calls)] == ["add"]


async def test_tool_choice_none_and_auto_leave_text_as_content(stack):
    client = stack.client()
    for choice in ("none", "auto"):
        r = await client.chat.completions.create(model=stack.model, messages=[user("hello")], tools=TOOLS,
                                                 tool_choice=choice, temperature=0, max_tokens=12)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


async def _agent_loop(client, model: str, salt: str, *, conversation: str | None, steps: int = 6):
    """A loop of forced single calls, each answered by a tool result; returns per step the
    (calls, cached tokens) and the full history."""
    history = [{"role": "system", "content": "You are an agent. Use the tools."}, user("Plan a trip to Oslo.")]
    suffix, outcome = list(history), []
    for step in range(steps):
        body = {"cache_salt": salt, **({"conversation_id": conversation} if conversation else {})}
        r = await client.chat.completions.create(
            model=model, messages=suffix if conversation else history, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=400, extra_body=body)
        message = r.choices[0].message
        calls = _check_calls(message.tool_calls)
        outcome.append((calls, r.usage.prompt_tokens_details.cached_tokens))
        results = [{"role": "tool", "tool_call_id": c.id, "content": f"result {step}: " + "ok " * (10 + step)}
                   for c in message.tool_calls]
        history += [{"role": "assistant", "content": message.content,
                     "tool_calls": [c.model_dump(exclude_none=True) for c in message.tool_calls]}, *results]
        suffix = results
    return outcome, history


async def test_an_agent_loop_is_served_from_cache_with_the_tokens_of_a_replay(stack):
    client = stack.client()
    async with stack.http() as http:
        hits = await metric(http, 'hybridserve_tool_resumes_total{result="hit"}')
        replies = await metric(http, "hybridserve_tool_call_replies_total")
    explicit, _ = await _agent_loop(client, stack.model, _salt(), conversation=f"agent-{uuid.uuid4().hex[:8]}")
    stateless, history = await _agent_loop(client, stack.model, _salt(), conversation=None)
    for step, ((calls, cached), (plain_calls, plain_cached)) in enumerate(zip(explicit, stateless)):
        assert calls == plain_calls, step  # the same greedy calls, whichever way the history came
        if step:
            assert cached > 0 and plain_cached > 0, (step, cached, plain_cached)
    # the last step from scratch (a salt nothing is cached under): the same calls
    replay = await client.chat.completions.create(
        model=stack.model, messages=history[:-2], tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=400, extra_body={"cache_salt": _salt()})
    assert replay.usage.prompt_tokens_details.cached_tokens == 0
    assert _check_calls(replay.choices[0].message.tool_calls) == explicit[-1][0]
    async with stack.http() as http:  # both loops' steps 2..6 brought tool results, from cache
        assert await metric(http, 'hybridserve_tool_resumes_total{result="hit"}') >= hits + 10
        assert await metric(http, "hybridserve_tool_call_replies_total") >= replies + 13


async def test_json_schema_replies_validate_for_twenty_random_schemas(stack):
    client = stack.client()

    async def one(seed: int):
        schema = random_schema(seed)
        r = await client.chat.completions.create(
            model=stack.model, messages=[user(f"Fill in form {seed}.")], temperature=1.0, seed=seed, max_tokens=800,
            response_format={"type": "json_schema", "json_schema": {"name": f"form{seed}", "schema": schema,
                                                                    "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)

    await asyncio.gather(*(one(seed) for seed in range(20)))
    r = await client.chat.completions.create(model=stack.model, messages=[user("any object")], temperature=0,
                                             max_tokens=20, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


async def test_a_deterministic_constrained_reply_keeps_its_bits_under_load(stack):
    client = stack.client()
    schema = random_schema(77)
    kwargs = dict(model=stack.model, messages=[user("Deterministic form.")], temperature=0.9, seed=11, max_tokens=600,
                  logprobs=True, response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}},
                  extra_body={"deterministic": True})

    def bits(r):
        return r.choices[0].message.content, [t.logprob.hex() for t in r.choices[0].logprobs.content]

    alone = bits(await client.chat.completions.create(**kwargs))
    load = [client.chat.completions.create(model=stack.model, messages=[user(f"load {i} " * (i + 1))],
                                           max_tokens=40, temperature=1.0) for i in range(6)]
    loaded, *_ = await asyncio.gather(client.chat.completions.create(**kwargs), *load)
    assert bits(loaded) == alone
    jsonschema.validate(json.loads(alone[0]), schema)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
])
async def test_unsupported_combinations_are_refused_naming_the_field(stack, body, param):
    async with stack.http() as http:
        response = await http.post("/v1/chat/completions", json={
            "model": stack.model, "messages": [user("hi")], "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] and error["param"].split(".")[0] == param, error


async def test_a_schema_that_cannot_compile_is_a_400(stack):
    async with stack.http() as http:
        response = await http.post("/v1/chat/completions", json={
            "model": stack.model, "messages": [user("hi")], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}})
    assert response.status_code == 400, response.text
    assert "schema" in response.json()["error"]["message"]
