"""pydantic-ai's Agent over the app (OpenAIChatModel with an OpenAIProvider at our base URL):
structured output into a pydantic model, and an agent that has a tool besides."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import Field
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.serve.clients.conftest import Weather

pytestmark = pytest.mark.timeout(300)
# One tool call per step: with parallel calls the random-weight model goes on calling until max_tokens.
SETTINGS = {"max_tokens": 200, "temperature": 0, "parallel_tool_calls": False}


def _model(stack, api_base: str) -> OpenAIChatModel:
    return OpenAIChatModel(stack.model, provider=OpenAIProvider(base_url=api_base, api_key="unused"))


async def test_structured_output_validates_with_usage(stack, api_base):
    agent = Agent(_model(stack, api_base), output_type=Weather,
                  model_settings=SETTINGS)
    result = await agent.run("the weather in Paris")
    assert isinstance(result.output, Weather)
    assert result.usage().input_tokens > 0 and result.usage().output_tokens > 0


async def test_an_agent_with_a_tool_ends_in_its_output_type(stack, api_base):
    looked_up: list[str] = []
    agent = Agent(_model(stack, api_base), output_type=Weather,
                  model_settings=SETTINGS)

    @agent.tool_plain
    def forecast(city: Annotated[str, Field(max_length=8)]) -> str:  # bounded, as Weather's fields
        """The forecast for a city."""
        looked_up.append(city)
        return "sunny, 21 degrees"

    result = await agent.run("the weather in Paris: look up the forecast first")
    assert isinstance(result.output, Weather)
    # Each tool call the model made was answered and sent back (the agent's history holds them all).
    returns = [p for m in result.all_messages() for p in m.parts if getattr(p, "part_kind", "") == "tool-return"]
    assert len([r for r in returns if r.tool_name == "forecast"]) == len(looked_up)
