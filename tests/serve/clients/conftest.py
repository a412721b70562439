"""The client libraries platform teams build on, each driving the session's app (tests/serve/
conftest.py `stack`: one Ray, one app, whatever folder asks) over HTTP through its own API.

The session's model never ends a reply by itself (never_ending): a plain reply runs to
max_tokens, and a reply held by a grammar (a forced tool call, a JSON schema) ends when the
grammar does, so `finish_reason == "stop"` there shows the grammar held it to the end."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from tests.serve.clients.client_venvs import ClientVenv

DRIVERS = Path(__file__).parent / "drivers"


class Weather(BaseModel):
    """The weather in a city (the schema of the tests' tool and structured outputs)."""

    # Bounded (a short name, a small integer): the random-weight model fills a field up to its bound
    city: str = Field(max_length=8)
    degrees: int = Field(ge=-50, le=50)


@pytest.fixture
def api_base(stack) -> str:
    """The OpenAI base URL of the session's app, as each library is configured with it."""
    return f"{stack.base_url}/v1"


async def drive(client_venv: ClientVenv, script: str, stack, *args: str) -> dict:
    """Run drivers/`script` in the library's own venv against the app (its arguments: the base URL,
    the model's name, then `args`); what it printed, as JSON."""
    python = client_venv.ensure()
    # Our package must not shadow theirs (the venv has its own openai and pydantic).
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1"}
    process = await asyncio.create_subprocess_exec(
        str(python), str(DRIVERS / script), f"{stack.base_url}/v1", stack.model, *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()[-4000:]
    return json.loads(out.decode().strip().splitlines()[-1])
