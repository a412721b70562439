"""Bad input gets OpenAI error bodies with the right 4xx code; auth scopes state to the key."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.serve.helpers import chat_turn, conversation, user

pytestmark = pytest.mark.timeout(300)


def assert_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize("patch", [
    {"temperature": 5}, {"top_p": 0}, {"n": 17}, {"n": 0}, {"messages": []}, {"max_tokens": 0},
    {"messages": [{"role": "wizard", "content": "hi"}]}, {"top_logprobs": 21}, {"stop": ["a"] * 5},
    {"conversation_id": ""}, {"seed": -1}, {"stream": "maybe"},
    # strict types, as OpenAI: no string or number read as a boolean, no string as a number
    {"stream": "yes"}, {"max_tokens": "12"}, {"deterministic": "1"}, {"logprobs": 1}, {"temperature": "0.5"},
], ids=lambda p: f"{next(iter(p))}={next(iter(p.values()))!r}")
async def test_invalid_fields_are_400(stack, patch):
    body = {"model": stack.model, "messages": [user("hi")], "max_tokens": 2, **patch}
    async with stack.http() as http:
        assert_error(await http.post("/v1/chat/completions", json=body), 400, "invalid_request")


@pytest.mark.parametrize("path,patch", [
    # chat's vLLM fields
    ("/v1/chat/completions", {"ignore_eos": "true"}), ("/v1/chat/completions", {"top_k": "5"}),
    ("/v1/chat/completions", {"min_p": "0.1"}), ("/v1/chat/completions", {"stop_token_ids": ["2"]}),
    # every field of completions
    ("/v1/completions", {"stream": "yes"}), ("/v1/completions", {"max_tokens": "12"}),
    ("/v1/completions", {"echo": "1"}), ("/v1/completions", {"deterministic": "1"}),
    ("/v1/completions", {"temperature": "0.5"}), ("/v1/completions", {"n": "2"}),
    ("/v1/completions", {"logprobs": "1"}), ("/v1/completions", {"prompt": [[1, "2"]]}),
    ("/tokenize", {"add_generation_prompt": "yes"}),
], ids=lambda p: p if isinstance(p, str) else f"{next(iter(p))}={next(iter(p.values()))!r}")
async def test_no_field_is_read_loosely(stack, path, patch):
    """Strict types, as OpenAI's server: a string is no boolean or number, a number no boolean."""
    base = {"/v1/chat/completions": {"messages": [user("hi")], "max_tokens": 2},
            "/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/tokenize": {"messages": [user("hi")]}}[path]
    body = {"model": stack.model, **base, **patch}
    async with stack.http() as http:
        assert_error(await http.post(path, json=body), 400)


async def test_malformed_json_and_unknown_routes(stack):
    async with stack.http() as http:
        bad = await http.post("/v1/chat/completions", content=b"{not json",
                              headers={"content-type": "application/json"})
        assert_error(bad, 400)
        assert_error(await http.get("/v1/nothing-here"), 404)
        assert_error(await http.get("/v1/conversations/abc"), 404)  # no cache_salt: the default scope
        assert_error(await http.get("/v1/conversations/abc", params={"cache_salt": "s"}), 404,
                     "conversation_not_found")
        assert_error(await http.delete("/v1/conversations/abc", params={"cache_salt": "s"}), 404)


async def test_too_long_is_400_and_a_body_too_large_413(stack):
    async with stack.http() as http:
        body = {"model": stack.model, "messages": [user("x" * 5000)], "max_tokens": 2}
        assert_error(await http.post("/v1/chat/completions", json=body), 400, "context_length_exceeded")
        huge = {"model": stack.model, "messages": [user("x" * (2 << 20))], "max_tokens": 2}
        assert_error(await http.post("/v1/chat/completions", json=huge), 413, "request_too_large")


async def test_delete_drops_the_conversation(stack, conv_id):
    client = stack.client()
    await chat_turn(client, stack.model, [user("remember me")], conversation_id=conv_id, cache_salt="d")
    async with stack.http() as http:
        gone = await http.delete(f"/v1/conversations/{conv_id}", params={"cache_salt": "d"})
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        assert_error(await http.get(f"/v1/conversations/{conv_id}", params={"cache_salt": "d"}), 404)
    again = await chat_turn(client, stack.model, [user("hello again")], conversation_id=conv_id, cache_salt="d")
    assert again.turn == 1 and again.cached_tokens == 0


async def test_health_and_metrics(stack, conv_id):
    client = stack.client()
    for text in ("m1", "m2"):
        await chat_turn(client, stack.model, [user(text)], conversation_id=conv_id, cache_salt="m", stream=True)
    async with stack.http() as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        text = (await http.get("/metrics")).text
    for name in ("hybridserve_time_to_first_token_seconds_bucket", "hybridserve_inter_token_latency_seconds_bucket",
                 "hybridserve_output_tokens_total", "hybridserve_cache_hits_total", "hybridserve_cached_tokens_total",
                 "hybridserve_lease_conflicts_total", "hybridserve_inflight_requests", "hybridserve_migrations_total"):
        assert name in text, name
    hits = [line for line in text.splitlines() if line.startswith("hybridserve_cache_hits_total ")]
    assert float(hits[0].split()[-1]) >= 1


async def test_api_keys_authenticate_and_scope_state(stack, notier, conv_id):
    def client(key):
        return openai.AsyncOpenAI(base_url=f"{stack.base_url}{notier}/v1", api_key=key, max_retries=0, timeout=120)

    with pytest.raises(openai.AuthenticationError):
        await client("wrong").models.list()
    async with stack.http() as http:  # no key and a bad body: the key is checked first
        assert_error(await http.post(f"{notier}/v1/chat/completions", json={"messages": []}), 401, "invalid_api_key")
    first = await chat_turn(client("k1"), stack.model, [user("mine")], conversation_id=conv_id, cache_salt="s")
    other = await chat_turn(client("k2"), stack.model, [user("yours")], conversation_id=conv_id, cache_salt="s")
    assert first.turn == 1 and other.turn == 1  # same id and salt, another key: another conversation
    async with stack.http() as http:
        assert_error(await http.get(f"{notier}/v1/conversations/{conv_id}", params={"cache_salt": "s"}), 401)


async def test_overload_is_503_with_retry_after(stack, notier):
    # The tier-off app admits one request at a time (max_inflight=1).
    async with stack.http() as http:
        headers = {"Authorization": "Bearer k1"}
        body = {"model": stack.model, "messages": [user("busy")], "max_tokens": 400}
        responses = await asyncio.gather(*[http.post(f"{notier}/v1/chat/completions", json=body, headers=headers)
                                           for _ in range(3)])
    statuses = sorted(r.status_code for r in responses)
    assert statuses[0] == 200 and 503 in statuses, statuses
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers["retry-after"] == "1" and rejected.json()["error"]["code"] == "overloaded"


async def test_history_the_template_cannot_extend_is_400_and_keeps_the_head(stack, conv_id):
    # Characters outside the vocabulary are committed as <|unk|>: the history's text no longer
    # renders back to its token ids, so no later turn can be appended to them (never a rewrite).
    client = stack.client()
    await chat_turn(client, stack.model, [user("h\u00e9llo \u2603")], conversation_id=conv_id, cache_salt="u")
    async with stack.http() as http:
        before = await conversation(http, conv_id, "u")
        body = {"model": stack.model, "messages": [user("next")], "max_tokens": 2, "conversation_id": conv_id,
                "cache_salt": "u"}
        assert_error(await http.post("/v1/chat/completions", json=body), 400, "invalid_request")
        after = await conversation(http, conv_id, "u")
        # tier_version may move meanwhile: the turn-1 export is asynchronous
        assert {**after["head"], "tier_version": 0} == {**before["head"], "tier_version": 0}
        assert after["turns"] == before["turns"]
