"""The official `openai` SDK's structured-output helper, `chat.completions.parse` with a
pydantic model (it sends the model's strict JSON schema as response_format and parses the reply
into it), against the session's app."""

from __future__ import annotations

import openai
import pytest

from tests.serve.clients.conftest import Weather

pytestmark = pytest.mark.timeout(300)


async def test_parse_gives_an_object_of_the_model(stack, api_base):
    client = openai.AsyncOpenAI(base_url=api_base, api_key="unused", max_retries=0)
    completion = await client.chat.completions.parse(
        model=stack.model, messages=[{"role": "user", "content": "the weather in Paris"}], response_format=Weather,
        max_tokens=200, temperature=0)
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"  # the schema's grammar ended it, not max_tokens
    assert isinstance(choice.message.parsed, Weather) and choice.message.refusal is None
