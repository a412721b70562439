"""langchain-openai's ChatOpenAI against the app: invoke, stream, bind_tools and
with_structured_output, configured as its docs show for an OpenAI-compatible server."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

from tests.serve.clients.conftest import Weather

pytestmark = pytest.mark.timeout(300)


def chat(stack, api_base: str, **kw) -> ChatOpenAI:
    return ChatOpenAI(model=stack.model, base_url=api_base, api_key="unused", temperature=0, max_retries=0, **kw)


async def test_invoke_and_stream_give_the_same_reply_with_usage(stack, api_base):
    llm = chat(stack, api_base, max_tokens=12, stream_usage=True)
    prompt = [HumanMessage("tell me about langchain")]
    whole = await llm.ainvoke(prompt)
    assert whole.content and whole.response_metadata["finish_reason"] == "length"
    assert whole.usage_metadata["output_tokens"] == 12 and whole.usage_metadata["input_tokens"] > 0
    chunks = [chunk async for chunk in llm.astream(prompt)]
    assert "".join(chunk.content for chunk in chunks) == whole.content  # temperature 0
    streamed = sum(chunks[1:], chunks[0])
    assert streamed.usage_metadata["output_tokens"] == 12


async def test_a_forced_tool_call_parses_into_its_schema(stack, api_base):
    # One call: with parallel calls the random-weight model goes on calling until max_tokens.
    llm = chat(stack, api_base, max_tokens=200).bind_tools([Weather], tool_choice="Weather",
                                                           parallel_tool_calls=False)
    reply = await llm.ainvoke("what is the weather in Paris?")
    assert reply.response_metadata["finish_reason"] in ("tool_calls", "stop")
    (call,) = reply.tool_calls
    assert call["name"] == "Weather" and call["id"]
    Weather.model_validate(call["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
async def test_structured_output_validates(stack, api_base, method):
    llm = chat(stack, api_base, max_tokens=200).with_structured_output(Weather, method=method)
    if method == "json_mode":  # the schema is the prompt's business there; the server keeps it JSON
        llm = chat(stack, api_base, max_tokens=200).with_structured_output(
            Weather.model_json_schema(), method="json_mode")
        assert isinstance(await llm.ainvoke("the weather in Paris, as JSON"), dict)
        return
    assert isinstance(await llm.ainvoke("the weather in Paris"), Weather)
