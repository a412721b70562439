"""Constrained decoding on the vLLM backend, with the checks our engine's tests make
(tests/grammar/test_constrained_engine.py, tests/serve/test_structured_outputs.py): the
random-weight model's replies under vLLM's guidance backend follow their grammars, end with
"stop", and forced tool calls parse into valid calls exactly as the template renders them.
All replies of a test run side by side on the session's one engine host."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from deployments.front.chat_models import tool_constraint
from proto.contract import ConversationRef
from tests.grammar.schemas import random_schema
from workers.errors import InvalidRequestError
from workers.request import FinishReason
from workers.sampling import SamplingParams

from .conftest import pytestmark  # noqa: F401  (skips without the vLLM venv)

COLOURS = ["red", "green", "blue and yellow"]
REGEX = r"(yes|no)-[0-9]{3}"
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": random_schema(100 + i)}}
         for i in range(3)]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


async def _reply(session, n: int, constraint, max_tokens: int = 600) -> tuple[str, FinishReason]:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7 + n, constraint=constraint)
    await session.prepare_grammar(params)
    messages = [{"role": "user", "content": f"answer number {n}, please"}]
    outs = [o async for o in session.stream_stateless(messages, params, f"so-{n}-{id(constraint)}", f"so-{n}")]
    assert outs[-1].error is None, outs[-1].error
    return "".join(o.text_delta for o in outs), outs[-1].finish_reason


async def _replies(session, constraints: list, max_tokens: int = 600) -> list[tuple[str, FinishReason]]:
    return await asyncio.gather(*(_reply(session, n, c, max_tokens) for n, c in enumerate(constraints)))


async def test_schemas_json_objects_choices_regexes_and_grammars_are_followed(dense_session):
    schemas = [random_schema(seed) for seed in range(4)]
    constraints = [{"type": "json_schema", "schema": s} for s in schemas] + [
        {"type": "json_object"}, {"type": "choice", "choices": COLOURS}, {"type": "regex", "regex": REGEX},
        {"type": "grammar", "grammar": 'start: "id:" DIGIT DIGIT ("!" | "?")\nDIGIT: /[0-9]/'},
        {"type": "grammar", "grammar": 'root ::= "ok" [0-9]'},  # GBNF, as vLLM takes it
        {"type": "json_schema", "schema": schemas[0], "whitespace_pattern": "  "}]
    replies = await _replies(dense_session, constraints)
    assert all(reason is FinishReason.STOP for _, reason in replies), replies
    texts = [text for text, _ in replies]
    for schema, text in zip(schemas, texts):
        jsonschema.validate(json.loads(text), schema)
        assert text == json.dumps(json.loads(text))  # json.dumps' separators, no free whitespace: our style
    assert isinstance(json.loads(texts[4]), dict)
    assert texts[5] in COLOURS
    assert re.fullmatch(REGEX, texts[6])
    assert re.fullmatch(r"id:[0-9]{2}[!?]", texts[7]) and re.fullmatch(r"ok[0-9]", texts[8])
    jsonschema.validate(json.loads(texts[9]), schemas[0])
    assert "  " in texts[9] and "\n" not in texts[9]  # the only whitespace allowed: two spaces


async def test_tool_calls_forced_parse_into_valid_calls_and_auto_runs_its_grammar(dense_session):
    """tool_choice "required" (parallel or not) and a named function, as the front builds them;
    "auto" beside them: vLLM takes its lazy grammar, and the reply is text or valid calls (the
    random model writes text: a begun call held valid is our engine's test)."""
    tool_format = dense_session.tool_format
    constraints = [tool_constraint(TOOLS, "required", True), tool_constraint(TOOLS, "required", False),
                   tool_constraint(TOOLS, {"type": "function", "function": {"name": "tool_2"}}, True)]
    replies, (auto_text, auto_reason) = await asyncio.gather(
        _replies(dense_session, constraints, max_tokens=3000),  # up to 8 calls, a character a token
        _reply(dense_session, len(constraints), tool_constraint(TOOLS, "auto", True), max_tokens=60))
    for (text, reason), parallel, names in zip(replies, (True, False, True), (SCHEMAS, SCHEMAS, ["tool_2"])):
        assert reason is FinishReason.STOP, text
        content, calls = tool_format.parse(text)
        assert content == "" and calls, text
        assert parallel or len(calls) == 1
        for call in calls:
            assert call.name in names
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert tool_format.calls_text(calls) == text  # what the template renders when the calls come back
    assert auto_reason in (FinishReason.STOP, FinishReason.LENGTH)
    for call in tool_format.parse(auto_text)[1]:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


async def test_a_constrained_turn_is_captured_and_committed(dense_session):
    """A conversation's turn under a schema: its head is kept like any other turn's."""
    schema = random_schema(11)
    constraint = {"type": "json_schema", "schema": schema}
    params = SamplingParams(max_tokens=600, temperature=1.0, seed=3, constraint=constraint)
    await dense_session.prepare_grammar(params)
    ref = ConversationRef("structured-turn", "s")
    outs = [o async for o in dense_session.stream_turn(ref, [{"role": "user", "content": "json"}], params, "so-turn")]
    assert outs[-1].finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads("".join(o.text_delta for o in outs)), schema)
    head = await dense_session.commit(outs[-1].turn_commit)
    assert head.turn == 1


async def test_a_bad_schema_is_refused_before_anything_runs(dense_session):
    """Checked by our compiler on the worker (a 400), as on our engine; a good one passes."""
    good = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    await dense_session.prepare_grammar(SamplingParams(max_tokens=4, constraint=good))
    bad = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}
    with pytest.raises(InvalidRequestError, match="the schema cannot be compiled"):
        await dense_session.prepare_grammar(SamplingParams(max_tokens=4, constraint=bad))
    with pytest.raises(InvalidRequestError, match="the regex cannot be compiled"):
        await dense_session.prepare_grammar(SamplingParams(max_tokens=4, constraint={"type": "regex", "regex": "("}))
