"""litellm's completion against the app through its `openai/` provider and `api_base`, as its
docs show for an OpenAI-compatible server: a reply, the same reply streamed, a forced tool call."""

from __future__ import annotations

import json
import os

import pytest

# litellm fetches its model price map from the internet on import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import litellm  # noqa: E402

from tests.serve.clients.conftest import Weather  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _args(stack, api_base: str, **kw) -> dict:
    return dict(model=f"openai/{stack.model}", api_base=api_base, api_key="unused", temperature=0, num_retries=0,
                messages=[{"role": "user", "content": "tell me about litellm"}], **kw)


async def test_completion_and_its_stream_agree_with_usage(stack, api_base):
    whole = await litellm.acompletion(**_args(stack, api_base, max_tokens=10))
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.content
    assert whole.usage.completion_tokens == 10 and whole.usage.prompt_tokens > 0
    stream = await litellm.acompletion(**_args(stack, api_base, max_tokens=10, stream=True,
                                               stream_options={"include_usage": True}))
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    rebuilt = litellm.stream_chunk_builder(chunks)
    assert rebuilt.usage.completion_tokens == 10


async def test_a_forced_tool_call_parses_into_its_schema(stack, api_base):
    tool = {"type": "function", "function": {"name": "get_weather", "description": Weather.__doc__,
                                             "parameters": Weather.model_json_schema()}}
    # One call: with parallel calls the random-weight model goes on calling until max_tokens.
    reply = await litellm.acompletion(**_args(stack, api_base, max_tokens=200, tools=[tool], parallel_tool_calls=False,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id
    Weather.model_validate(json.loads(call.function.arguments))
