"""Run in the instructor venv (client_venvs.py), not by pytest: instructor's structured output
from a pydantic model against the app, in tools mode and JSON-schema mode. Prints what it got
as JSON for test_instructor.py to check.

    python instructor_calls.py BASE_URL MODEL
"""

import json
import sys

import instructor
import openai
from pydantic import BaseModel, Field


class Weather(BaseModel):
    """The weather in a city (tests/serve/clients/conftest.py has the same model)."""

    city: str = Field(max_length=8)
    degrees: int = Field(ge=-50, le=50)


def main(base_url: str, model: str) -> None:
    got = {}
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0), mode=mode)
        # One call in tools mode: with parallel calls the random-weight model goes on until max_tokens.
        extra = {"parallel_tool_calls": False} if mode is instructor.Mode.TOOLS else {}
        weather, completion = client.chat.completions.create_with_completion(
            model=model, response_model=Weather, max_retries=0, max_tokens=200, temperature=0,
            messages=[{"role": "user", "content": "the weather in Paris"}], **extra)
        got[mode.name] = {"weather": weather.model_dump(), "finish_reason": completion.choices[0].finish_reason,
                          "prompt_tokens": completion.usage.prompt_tokens}
    print(json.dumps(got))


if __name__ == "__main__":
    main(*sys.argv[1:3])
