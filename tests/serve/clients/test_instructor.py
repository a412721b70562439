"""instructor's structured output from a pydantic model against the app, in tools mode (a
forced tool call) and JSON-schema mode (response_format), driven in its own venv (it pins an
older openai than ours: client_venvs.py)."""

from __future__ import annotations

import pytest

from tests.serve.clients.client_venvs import ClientVenv
from tests.serve.clients.conftest import Weather, drive

pytestmark = pytest.mark.timeout(300)


async def test_both_modes_give_an_object_of_the_model(stack):
    got = await drive(ClientVenv.INSTRUCTOR, "instructor_calls.py", stack)
    assert got["TOOLS"]["finish_reason"] == "tool_calls" and got["JSON_SCHEMA"]["finish_reason"] == "stop"
    for mode in ("TOOLS", "JSON_SCHEMA"):
        Weather.model_validate(got[mode]["weather"])
        assert got[mode]["prompt_tokens"] > 0
