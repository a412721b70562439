"""vLLM's structured outputs through the official client (`extra_body`), on chat completions and
completions: the test model never stops by itself, so each reply ending with "stop" and
following its grammar shows the grammar held it. One kind per request; a regex, grammar or
schema that cannot compile, or a backend that cannot be honoured, is a 400 naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.grammar.schemas import random_schema
from tests.serve.helpers import user

pytestmark = pytest.mark.timeout(300)

COLOURS = ["red", "green", "blue and yellow"]
REGEX = r"(yes|no)-[0-9]{3}"
GRAMMAR = 'start: "id:" DIGIT DIGIT ("!" | "?")\nDIGIT: /[0-9]/'


async def _chat(stack, **extra):
    r = await stack.client().chat.completions.create(model=stack.model, messages=[user("pick one")], max_tokens=300,
                                                      temperature=1.0, seed=5, extra_body=extra)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    return r.choices[0].message.content


async def _complete(stack, stream: bool = False, **extra):
    client = stack.client()
    kwargs = dict(model=stack.model, prompt="The answer is", max_tokens=300, temperature=1.0, seed=9, extra_body=extra)
    if not stream:
        r = await client.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].text
    chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    return "".join(c.choices[0].text for c in chunks)


async def test_choice_regex_grammar_and_json_hold_a_chat_reply(stack):
    assert await _chat(stack, guided_choice=COLOURS) in COLOURS
    assert await _chat(stack, structured_outputs={"choice": COLOURS}) in COLOURS
    assert re.fullmatch(REGEX, await _chat(stack, guided_regex=REGEX))
    assert re.fullmatch(REGEX, await _chat(stack, structured_outputs={"regex": REGEX}))
    assert re.fullmatch(r"id:[0-9]{2}[!?]", await _chat(stack, guided_grammar=GRAMMAR))
    gbnf = 'root ::= "ok" [0-9]'  # vLLM's grammars may be GBNF too
    assert re.fullmatch(r"ok[0-9]", await _chat(stack, structured_outputs={"grammar": gbnf}))
    for seed in range(3):
        schema = random_schema(100 + seed)
        jsonschema.validate(json.loads(await _chat(stack, guided_json=schema)), schema)
        as_text = {"json": json.dumps(schema)}  # vLLM takes the schema as its JSON text too
        jsonschema.validate(json.loads(await _chat(stack, structured_outputs=as_text)), schema)
    assert isinstance(json.loads(await _chat(stack, structured_outputs={"json_object": True})), dict)
    # tool_choice "auto" beside a structured output: the structured output wins (as response_format does)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert await _chat(stack, guided_choice=COLOURS, tools=tools) in COLOURS


async def test_whitespace_pattern_and_closed_objects_shape_json(stack):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    reply = await _chat(stack, guided_json=schema, guided_whitespace_pattern="  ", guided_decoding_backend="guidance")
    assert json.loads(reply)["a"] in range(10) and "  " in reply  # the only whitespace allowed: two spaces
    closed = await _chat(stack, structured_outputs={"json": schema, "disable_additional_properties": True})
    assert list(json.loads(closed)) == ["a"]


async def test_structured_outputs_hold_a_completion(stack):
    assert await _complete(stack, guided_choice=COLOURS) in COLOURS
    assert re.fullmatch(REGEX, await _complete(stack, structured_outputs={"regex": REGEX}))
    assert re.fullmatch(REGEX, await _complete(stack, stream=True, guided_regex=REGEX))
    schema = random_schema(7)
    jsonschema.validate(json.loads(await _complete(stack, structured_outputs={"json": schema})), schema)


async def test_priority_is_served_and_changes_nothing_alone(stack):
    kwargs = dict(model=stack.model, messages=[user("same")], max_tokens=6, temperature=0)
    plain = await stack.client().chat.completions.create(**kwargs)
    urgent = await stack.client().chat.completions.create(**kwargs, extra_body={"priority": -10})
    assert urgent.choices[0].message.content == plain.choices[0].message.content
    late = await stack.client().completions.create(model=stack.model, prompt="x", max_tokens=3,
                                                   extra_body={"priority": 7})
    assert late.choices[0].finish_reason == "length"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("extra, param, says", [
    ({"guided_regex": "(yes|no"}, None, "the regex cannot be compiled"),
    ({"structured_outputs": {"grammar": "start: ("}}, None, "the grammar cannot be compiled"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}, None,
     "the schema cannot be compiled"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "guided_regex and guided_choice"),
    ({"guided_json": {}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex", "guided_json and"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice", "only one kind"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"guided_choice": []}, "guided_choice", "at least 1 item"),
    # a character no token of the model spells: the reply cannot begin (found by the fuzz test as a 500)
    ({"guided_regex": "\x08"}, None, "allows no first token"),
])
async def test_what_cannot_be_served_is_a_400_naming_it(stack, endpoint, extra, param, says):
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as refused:
        if endpoint == "chat":
            await client.chat.completions.create(model=stack.model, messages=[user("hi")], max_tokens=4,
                                                 extra_body=extra)
        else:
            await client.completions.create(model=stack.model, prompt="hi", max_tokens=4, extra_body=extra)
    error = refused.value.body
    assert param is None or error["param"] == param, error
    assert says in error["message"], error
    assert (error["code"] == "unsupported_parameter") == (says == "not supported"), error  # served, but not so


@pytest.mark.parametrize("stream", [False, True])
async def test_a_constraint_that_leads_nowhere_midway_is_the_requests_error_not_the_servers(stack, stream):
    """"a" then a character no token spells: the reply begins, then the grammar allows nothing
    the model may produce. The request's doing: a 400 before anything was sent, an error event
    of type invalid_request_error in a stream, never a 500."""
    body = {"model": stack.model, "prompt": "hi", "max_tokens": 8, "guided_regex": "a\x08", "stream": stream}
    async with stack.http() as http:
        response = await http.post("/v1/completions", json=body)
    if not stream:
        assert response.status_code == 400, response.text
        assert "allows no token" in response.json()["error"]["message"]
        return
    assert response.status_code == 200, response.text
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: {")]
    errors = [json.loads(e)["error"] for e in events if "error" in json.loads(e)]
    assert errors and errors[-1]["type"] == "invalid_request_error", response.text


async def test_a_structured_output_beside_another_constraint_is_a_400_naming_both(stack):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for other, named in (({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}}},
                          "response_format"), ({"tools": tools, "tool_choice": "required"}, "tool_choice")):
        async with stack.http() as http:
            response = await http.post("/v1/chat/completions", json={
                "model": stack.model, "messages": [user("hi")], "max_tokens": 4, "guided_regex": "a", **other})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "guided_regex" and named in error["message"], error
