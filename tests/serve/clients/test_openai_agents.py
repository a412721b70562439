"""The OpenAI Agents SDK (`openai-agents`) over the app: an agent with a function tool run over
the chat completions model class, and a Responses agent continuing with previous_response_id."""

from __future__ import annotations

from typing import Annotated

import openai
import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from pydantic import Field

from tests.serve.clients.conftest import Weather

pytestmark = pytest.mark.timeout(300)

set_tracing_disabled(True)  # traces would be exported to OpenAI's servers


def _client(api_base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api_base, api_key="unused", max_retries=0)


async def test_a_function_tool_runs_with_arguments_of_its_schema(stack, api_base):
    calls: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather in a city over the next days."""
        calls.append((city, days))
        return "sunny"

    # Forced once: the SDK resets tool_choice after a tool call, so the second step answers in text.
    agent = Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=stack.model, openai_client=_client(api_base)),
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=100, temperature=0))
    result = await Runner.run(agent, "what is the weather in Paris this week?", max_turns=3)
    assert len(calls) == 1 and len(calls[0][0]) <= 8 and 1 <= calls[0][1] <= 7  # parsed, validated, run
    assert isinstance(result.final_output, str) and result.final_output
    assert result.context_wrapper.usage.requests == 2 and result.context_wrapper.usage.input_tokens > 0


async def test_a_responses_agent_continues_from_its_previous_response(stack, api_base):
    client = _client(api_base)
    # Structured output: the schema's grammar ends each reply (a reply cut at max_tokens is a
    # `response.incomplete`, which the SDK raises on, as it would with OpenAI's).
    agent = Agent(name="weather", instructions="Be brief.", output_type=Weather,
                  model=OpenAIResponsesModel(model=stack.model, openai_client=client),
                  model_settings=ModelSettings(max_tokens=200, temperature=0))
    first = await Runner.run(agent, "the weather in Paris")
    second = await Runner.run(agent, "and in Rome?", previous_response_id=first.last_response_id)
    assert isinstance(first.final_output, Weather) and isinstance(second.final_output, Weather)
    stored = await client.responses.retrieve(second.last_response_id)
    assert stored.previous_response_id == first.last_response_id
    assert stored.usage.input_tokens_details.cached_tokens > 0  # the first exchange was not computed again
