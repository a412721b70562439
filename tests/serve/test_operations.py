"""What operators and their tools read: /metrics under vLLM's names (read with prometheus_client's
own text parser, as a scraper would), a per-key rate limit (429, distinct from the 503 of an
overloaded server), optional CORS, error types right for every status, `Bearer` in any case."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from deployments import errors
from deployments.front import guard
from deployments.front.rate_limit import RateLimiter
from tests.serve.conftest import SERVED_NAMES
from tests.serve.helpers import chat_turn, user

pytestmark = pytest.mark.timeout(300)

# What the Gateway API inference extension, KEDA and vLLM's dashboards read.
VLLM_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
VLLM_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens")
VLLM_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                   "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds")


async def scrape(http) -> dict[str, dict[str, float]]:
    """{family: {sample name: value}} of the model's samples (model_name: the canonical name)."""
    families = text_string_to_metric_families((await http.get("/metrics")).text)
    found: dict[str, dict[str, float]] = {}
    for family in families:
        for sample in family.samples:
            if sample.labels.get("model_name") == SERVED_NAMES[0] and "le" not in sample.labels:
                found.setdefault(family.name, {})[sample.name] = found.get(family.name, {}).get(sample.name, 0) \
                    + sample.value
    return found


async def test_metrics_under_vllm_names(stack):
    client = stack.client()
    salt = f"metrics-{uuid.uuid4().hex}"
    async with stack.http() as http:
        before = await scrape(http)
        # One prompt twice under one salt: the second reuses the first's state (prefix hits).
        for _ in range(2):
            await chat_turn(client, stack.model, [user("count me in vLLM's terms")], conversation_id=None,
                            cache_salt=salt, stream=True, max_tokens=6)
        after = await scrape(http)
        for name in VLLM_GAUGES:
            assert name in after, name
        assert 0.0 <= after["vllm:kv_cache_usage_perc"]["vllm:kv_cache_usage_perc"] <= 1.0
        grew = {name: after[name][f"{name}_total"] - before.get(name, {}).get(f"{name}_total", 0)
                for name in VLLM_COUNTERS}
        assert grew["vllm:generation_tokens"] == 12 and grew["vllm:prefix_cache_queries"] >= 2
        assert 0 < grew["vllm:prefix_cache_hits"] < grew["vllm:prefix_cache_queries"] == grew["vllm:prompt_tokens"]
        for name in VLLM_HISTOGRAMS:
            count = after[name][f"{name}_count"] - before.get(name, {}).get(f"{name}_count", 0)
            assert count >= 2, (name, count)

        # While a reply streams its request is running, and its blocks are in use on a replica.
        stream = await client.chat.completions.create(
            model=stack.model, messages=[user("a long one")], max_tokens=1500, temperature=0, stream=True,
            extra_body={"cache_salt": salt})
        async with stream:
            await anext(aiter(stream))
            seen = await scrape(http)
            assert seen["vllm:num_requests_running"]["vllm:num_requests_running"] >= 1
            for _ in range(100):  # routing stats reach the ingress within about a second
                if seen["vllm:kv_cache_usage_perc"]["vllm:kv_cache_usage_perc"] > 0:
                    break
                await asyncio.sleep(0.1)
                seen = await scrape(http)
            assert seen["vllm:kv_cache_usage_perc"]["vllm:kv_cache_usage_perc"] > 0


def ttft_counts(text: str) -> dict[str, float]:
    """{turn label: observations} of hybridserve_time_to_first_token_seconds."""
    return {sample.labels["turn"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "hybridserve_time_to_first_token_seconds_count"}


async def test_ttft_is_counted_by_the_turn_of_its_conversation(stack, conv_id):
    client = stack.client()
    history = [user("time my turns")]
    async with stack.http() as http:
        before = ttft_counts((await http.get("/metrics")).text)
        for _ in range(3):
            reply = await chat_turn(client, stack.model, history[-1:], conversation_id=conv_id, cache_salt="ttft",
                                    stream=True, max_tokens=4)
            history += [{"role": "assistant", "content": reply.text}, user("and again")]
        await chat_turn(client, stack.model, history[:1], conversation_id=None, cache_salt="ttft", stream=True,
                        max_tokens=4)
        after = ttft_counts((await http.get("/metrics")).text)
    grew = {turn: after[turn] - before.get(turn, 0) for turn in after}
    assert grew == {"1": 1, "2": 1, "3-4": 1, "5-8": 0, "9-16": 0, "17-32": 0, "33+": 0, "stateless": 1}


def guarded_app(**state) -> FastAPI:
    """The real error handlers and guard around one route per method of interest."""
    app = FastAPI()
    errors.install(app)
    guard.install(app)
    for key, value in state.items():
        setattr(app.state, key, value)

    @app.post("/v1/echo")
    async def echo() -> dict:
        return {"ok": True}

    return app


def test_a_key_over_its_rate_gets_429_with_retry_after_and_other_keys_go_on():
    clock = [0.0]
    app = guarded_app(api_keys=frozenset({"k1", "k2"}), rate_limiter=RateLimiter(2, clock=lambda: clock[0]))
    with TestClient(app) as client:
        k1, k2 = {"Authorization": "Bearer k1"}, {"Authorization": "bearer k2"}  # the scheme in any case
        assert [client.post("/v1/echo", headers=k1).status_code for _ in range(2)] == [200, 200]
        limited = client.post("/v1/echo", headers=k1)
        assert limited.status_code == 429 and limited.headers["retry-after"] == "30"  # 2 a minute: one per 30 s
        assert limited.json()["error"] | {"message": ""} == {"message": "", "type": "rate_limit_error",
                                                              "code": "rate_limit_exceeded", "param": None}
        assert client.post("/v1/echo", headers=k2).status_code == 200
        clock[0] = 30.0
        assert client.post("/v1/echo", headers=k1).status_code == 200
        assert client.post("/v1/echo", headers=k1).status_code == 429
        assert client.post("/v1/echo", headers={"Authorization": "Basic k1"}).status_code == 401


def test_cors_when_configured_and_none_otherwise():
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with TestClient(guarded_app(api_keys=frozenset({"k1"}), cors_allow_origins=("https://app.example",))) as client:
        allowed = client.options("/v1/echo", headers=preflight)  # no key on a preflight: still answered
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        call = client.post("/v1/echo", headers={"Origin": "https://app.example", "Authorization": "Bearer k1"})
        assert call.status_code == 200 and call.headers["access-control-allow-origin"] == "https://app.example"
        other = client.options("/v1/echo", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    with TestClient(guarded_app()) as client:
        assert "access-control-allow-origin" not in client.post("/v1/echo", headers={"Origin": "https://x"}).headers


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (409, "conflict_error"),
    (413, "invalid_request_error"), (422, "invalid_request_error"), (429, "rate_limit_error"),
    (500, "server_error"), (503, "service_unavailable"),
])
def test_every_status_has_its_error_type(status, kind):
    assert errors.APIError(status, "m", "c").body()["error"]["type"] == kind


def test_a_wrong_method_is_405_typed_as_the_request_s_fault():
    with TestClient(guarded_app()) as client:
        wrong = client.get("/v1/echo")
    assert wrong.status_code == 405
    assert wrong.json()["error"]["type"] == "invalid_request_error" and wrong.json()["error"]["code"] == \
        "method_not_allowed"
