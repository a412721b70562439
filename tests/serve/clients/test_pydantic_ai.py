"""pydantic-ai's Agent over the app (OpenAIChatModel with an OpenAIProvider at our base URL):
structured output into a pydantic model. (An agent with a tool besides its output type ran to
max_tokens on the random-weight model, 200 and 600 alike: not kept until its cause is known.)"""

from __future__ import annotations

import pytest
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
