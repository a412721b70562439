"""llama-index's OpenAILike against the app, as a chat model and in its default completion mode
(the legacy completions endpoint), driven in its own venv (it pins openai 2.x: client_venvs.py).
Each reply equals the official SDK's for the same request at temperature 0, streamed or not."""

from __future__ import annotations

import pytest

from tests.serve.clients.client_venvs import ClientVenv
from tests.serve.clients.conftest import drive
from tests.serve.helpers import user

pytestmark = pytest.mark.timeout(300)


async def test_chat_and_completion_modes_answer_as_the_official_sdk(stack):
    got = await drive(ClientVenv.LLAMA_INDEX, "llama_index_calls.py", stack)
    client = stack.client()
    chat = await client.chat.completions.create(model=stack.model, messages=[user("tell me about llama-index")],
                                                max_tokens=10, temperature=0)
    completion = await client.completions.create(model=stack.model, prompt="The answer is", max_tokens=10,
                                                 temperature=0)
    assert got["chat"] == got["chat_stream"] == chat.choices[0].message.content
    assert got["completion"] == got["completion_stream"] == completion.choices[0].text
