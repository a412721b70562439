"""Input the app cannot serve is refused up front with a 4xx OpenAI error body, never a 5xx,
never after the reply streamed, never a 503 a client would retry forever; and fields the server
does not implement are refused rather than ignored."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from cache_service.client import SERVICE_LIMITS
from deployments import errors
from deployments.front.chat_models import MAX_MESSAGES, MAX_SALT_BYTES
from deployments.app import build_app
from deployments.messages import ErrorKind
from deployments.settings import MAX_BODY_BYTES, AppSettings
from tests.serve.helpers import chat_turn, user
from tests.serve.test_http_errors import assert_error

pytestmark = pytest.mark.timeout(300)


def body(stack, **fields) -> dict:
    return {"model": stack.model, "messages": [user("hi")], "max_tokens": 2, **fields}


# -- limits of the cache service, checked before the turn runs -------------------------------------
async def test_a_suffix_the_service_could_not_publish_is_400_before_the_turn(stack, conv_id):
    # The reply makes the published turn one message longer than the request's suffix.
    assert MAX_MESSAGES == SERVICE_LIMITS.max_messages_per_turn - 1
    messages = [user("")] * (MAX_MESSAGES + 1)
    async with stack.http() as http:
        refused = await http.post("/v1/chat/completions",
                                  json=body(stack, messages=messages, conversation_id=conv_id, cache_salt="lim"))
        assert assert_error(refused, 400, "invalid_request")["param"] == "messages"
        never_started = await http.get(f"/v1/conversations/{conv_id}", params={"cache_salt": "lim"})
        assert_error(never_started, 404, "conversation_not_found")


async def test_ids_and_salts_over_the_service_limit_in_bytes_are_400_not_503(stack, notier, conv_id):
    async with stack.http() as http:
        wide = "\u00e9" * 200  # 200 characters, 400 bytes
        refused = await http.post("/v1/chat/completions", json=body(stack, conversation_id=wide))
        assert assert_error(refused, 400, "invalid_request")["param"] == "conversation_id"
        # With API keys the key's scope is prefixed to the salt: the caller's part has less room.
        headers = {"Authorization": "Bearer k1"}
        salted = body(stack, conversation_id=conv_id, cache_salt="s" * (MAX_SALT_BYTES + 1))
        refused = await http.post(f"{notier}/v1/chat/completions", json=salted, headers=headers)
        assert assert_error(refused, 400, "invalid_request")["param"] == "cache_salt"
        read = await http.get(f"{notier}/v1/conversations/{conv_id}", headers=headers,
                              params={"cache_salt": "s" * (MAX_SALT_BYTES + 1)})
        assert assert_error(read, 400)["param"] == "cache_salt"
        fits = body(stack, conversation_id=conv_id, cache_salt="s" * MAX_SALT_BYTES)
        assert (await http.post(f"{notier}/v1/chat/completions", json=fits, headers=headers)).status_code == 200


def test_settings_beyond_the_service_limits_fail_the_build():
    with pytest.raises(ValidationError, match="lease_ttl_s=3600 is over the cache service's longest lease"):
        build_app({"lease_ttl_s": 3600})
    with pytest.raises(ValidationError, match="max_body_bytes"):
        build_app({"max_body_bytes": MAX_BODY_BYTES + 1})
    assert AppSettings(lease_ttl_s=SERVICE_LIMITS.max_lease_ttl_ms / 1000, max_body_bytes=MAX_BODY_BYTES)


# -- bad input is a 400, internals never reach the client ------------------------------------------
async def test_text_that_is_not_unicode_is_400(stack):
    raw = json.dumps(body(stack, messages=[user("a \ud800 b")]))  # json.dumps keeps it as "\ud800"
    async with stack.http() as http:
        refused = await http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert assert_error(refused, 400, "invalid_request")["param"] == "messages.0.content"


async def test_a_single_stop_string_of_any_reasonable_length(stack):
    async with stack.http() as http:
        ok = await http.post("/v1/chat/completions", json=body(stack, stop="Observation:"))
        assert ok.status_code == 200, ok.text
        assert_error(await http.post("/v1/chat/completions", json=body(stack, stop="x" * 257)), 400)


def test_a_500_tells_the_client_nothing_internal():
    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom():
        raise TypeError("secret internals")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom", headers={"x-request-id": "rid-7"})
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "rid-7" in error["message"] and "secret" not in error["message"] and "TypeError" not in error["message"]
    failed = errors.from_kind(ErrorKind.INTERNAL, "the worker failed: TypeError: secret internals")
    assert failed.status == 500 and "secret" not in failed.message and "TypeError" not in failed.message


# -- fields not implemented ------------------------------------------------------------------------
@pytest.mark.parametrize("field", [
    {"functions": [{"name": "f"}]}, {"function_call": "auto"},
    {"audio": {"voice": "x"}},
    {"modalities": ["text", "audio"]}, {"prediction": {"type": "content", "content": "x"}},
    {"reasoning_effort": "high"}, {"store": True}, {"no_such_field": 1},
], ids=lambda f: next(iter(f)))
async def test_fields_not_implemented_are_refused_by_name(stack, field):
    async with stack.http() as http:
        refused = await http.post("/v1/chat/completions", json=body(stack, **field))
        error = assert_error(refused, 400, "unsupported_parameter")
    assert error["param"].split(".")[0] == next(iter(field)) and "not supported" in error["message"]


async def test_harmless_fields_of_clients_are_accepted(stack):
    reply = await chat_turn(stack.client(), stack.model, [user("hi")], conversation_id=None, stream=True,
                            user="u-1", metadata={"trace": "t"}, service_tier="auto", store=False,
                            parallel_tool_calls=False, tools=[], presence_penalty=0, frequency_penalty=0,
                            response_format={"type": "text"}, modalities=["text"], safety_identifier="h")
    assert reply.finish_reason == "length"
    history = [user("hi"), {"role": "assistant", "content": reply.text, "refusal": None, "annotations": [],
                            "audio": None, "function_call": None, "tool_calls": None}, user("and?")]
    assert (await chat_turn(stack.client(), stack.model, history, conversation_id=None)).finish_reason == "length"


# -- the body limit counts the bytes received -----------------------------------------------------
async def test_a_chunked_body_over_the_limit_is_413(stack):
    payload = json.dumps(body(stack, messages=[user("x" * (2 << 20))])).encode()  # max_body_bytes: 1 MiB

    async def chunks(data: bytes):
        for i in range(0, len(data), 64 << 10):
            yield data[i:i + (64 << 10)]

    async with stack.http() as http:
        refused = await http.post("/v1/chat/completions", content=chunks(payload),
                                  headers={"content-type": "application/json"})
        assert_error(refused, 413, "request_too_large")
        small = json.dumps(body(stack, stop="Observation:")).encode()
        ok = await http.post("/v1/chat/completions", content=chunks(small), headers={"content-type": "application/json"})
        assert ok.status_code == 200, ok.text
