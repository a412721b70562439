"""Response ids and the Responses API's stream, without a server: the events the official client
parses, in its types, and a streamed response equal to the one built whole."""

from __future__ import annotations

import base64
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deployments.errors import APIError
from deployments.messages import Recovery, ToolCall, ToolCallDelta, TurnDelta, TurnDone
from deployments.front.responses_plan import STORED_ECHO
from deployments.front.responses_format import ResponseBody, ResponseId, ResponseStream
from deployments.front.responses_models import ResponsesRequest, engine_messages

PUBLISH = "resp-" + "ab" * 16


def _raw(value) -> str:
    return "resp_" + base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


def test_ids_round_trip_and_anything_else_names_nothing():
    rid = ResponseId("conv_1", 3, PUBLISH)
    assert ResponseId.parse(str(rid)) == rid
    assert ResponseId.parse(str(ResponseId(None, 0, PUBLISH))) is None  # store=false
    for publish in ["chatcmpl-1", "idem-ab-cd"]:  # chat completions' conversation turns are stored responses too
        assert ResponseId.parse(str(ResponseId("c", 1, publish))) == ResponseId("c", 1, publish)
    for bad in ["", "resp_", "resp_!!", "chatcmpl-1", _raw(["c", 0, PUBLISH]), _raw(["c", True, PUBLISH]),
                _raw(["c", 1 << 32, PUBLISH]), _raw(["", 1, PUBLISH]), _raw(["c" * 257, 1, PUBLISH]),
                _raw(["c", 1, "other-1"]), _raw(["c", 1, ""]), _raw(["\ud800", 1, PUBLISH]), _raw({"c": 1}), _raw(["c", 1])]:
        assert ResponseId.parse(bad) is None, bad


def test_a_deeply_nested_or_overlong_id_names_nothing():
    """JSON nested past Python's recursion limit raised RecursionError (a 500 on GET
    /v1/responses/{id}); an id far longer than any of ours is not decoded at all."""
    nested = "resp_" + base64.urlsafe_b64encode(b"[" * 100_000).decode().rstrip("=")
    assert ResponseId.parse(nested) is None
    longest = ResponseId("\u0001" * 256, 1 << 31, "idem-" + "f" * 64)  # escaped: six JSON characters a byte
    assert ResponseId.parse(str(longest)) == longest
    assert ResponseId.parse(_raw(["c", 1, PUBLISH + "0" * 100_000])) is None


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest(model="m", input="hi", **fields)


def _events(deltas: list[TurnDelta], done: TurnDone) -> tuple[list, ResponseBody]:
    form = ResponseBody(ResponseId("conv_1", 1, PUBLISH), "m", _request(tools=[
        {"type": "function", "name": "f", "parameters": {}}]).echo())
    stream = ResponseStream(form)
    chunks = list(stream.start()) + [c for d in deltas for c in stream.delta(d)] + list(stream.end(done))
    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    for chunk in chunks:
        event_line, data_line = chunk.strip().split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {payload['type']}"
        events.append(adapter.validate_python(payload))
    return events, form


@pytest.mark.parametrize("reason", ["tool_calls", "length"])
def test_a_stream_of_text_and_a_call_parses_and_ends_as_the_whole_response(reason):
    call = ToolCall("call_1", "f", '{"a":1}')
    deltas = [TurnDelta("he", (1,)), TurnDelta("llo", (2,)),
              TurnDelta("", (3,), None, (ToolCallDelta(0, "call_1", "f", '{"a"'),)),
              TurnDelta("", (4,), None, (ToolCallDelta(0, arguments=":1}"),))]
    done = TurnDone(reason, 5, 4, 2, Recovery.NEW, "r", tool_calls=(call,))
    events, form = _events(deltas, done)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = "response.incomplete" if reason == "length" else "response.completed"
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", final]
    whole = Response.model_validate(form.done("hello", done))
    assert events[-1].response == whole.model_copy(update={"completed_at": events[-1].response.completed_at})
    assert whole.output_text == "hello" and whole.output[1].arguments == '{"a":1}'
    assert whole.usage.input_tokens_details.cached_tokens == 2 and whole.usage.total_tokens == 9
    assert (whole.status == "incomplete") == (reason == "length")


def test_an_empty_reply_is_still_one_message():
    events, _ = _events([], TurnDone("stop", 5, 0, 0, Recovery.NEW, "r"))
    assert [e.type for e in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[-1].response.output[0].content[0].text == ""


def test_a_failure_is_an_error_event_then_the_failed_response():
    form = ResponseBody(ResponseId("conv_1", 1, PUBLISH), "m", _request().echo())
    stream = ResponseStream(form)
    list(stream.start())
    chunks = list(stream.error(APIError(409, "the lease was lost", "conversation_conflict")))
    adapter = TypeAdapter(ResponseStreamEvent)
    error, failed = (adapter.validate_python(json.loads(c.split("data: ", 1)[1])) for c in chunks)
    assert (error.type, error.code, error.sequence_number) == ("error", "conversation_conflict", 2)
    assert failed.type == "response.failed" and failed.response.error.code == "server_error"
    assert failed.response.status == "failed"


def test_a_stored_response_is_a_valid_response():
    stored = ResponseBody(ResponseId("conv_1", 2, PUBLISH), "m", STORED_ECHO, "resp_previous")
    body = Response.model_validate(stored.finished("text", (), "stop", 3, 4, 1))
    assert body.previous_response_id == "resp_previous" and body.conversation.id == "conv_1"
    assert body.output_text == "text" and body.status == "completed" and body.incomplete_details is None


def test_input_items_become_engine_messages():
    request = ResponsesRequest(model="m", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ])
    call = lambda i: {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}}  # noqa: E731
    assert engine_messages(request.input) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "let me look", "tool_calls": [call("c1"), call("c2")]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    assert engine_messages("hi") == [{"role": "user", "content": "hi"}]


def test_forced_choices_and_formats_become_the_constraint():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    assert _request().constraint() is None
    assert _request(text={"format": {"type": "json_object"}}).constraint() == {"type": "json_object"}
    assert _request(text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"},
                                     "strict": True}}).constraint() == {
        "type": "json_schema", "schema": {"type": "object"}, "strict": True}
    assert _request(tools=tools, tool_choice={"type": "function", "name": "f"},
                    parallel_tool_calls=False).constraint() == {
        "type": "tool_calls", "parallel": False, "auto": False,
        "tools": [{"name": "f", "parameters": {"type": "object"}}]}
    # "auto": the model may call or not, but a call it begins must be valid; "none": nothing
    assert _request(tools=tools).constraint()["auto"] is True
    assert _request(tools=tools, tool_choice="none").constraint() is None
    assert _request(tools=tools, text={"format": {"type": "json_object"}}).constraint() == {"type": "json_object"}
