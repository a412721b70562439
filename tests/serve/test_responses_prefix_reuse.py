"""A Responses request opening a stored conversation reuses the prefix its scope shares (its
instructions and tool catalogue) exactly as a chat completion opening a conversation does;
another salt or API key gets nothing; the output is that of a request computed from scratch.
(Two started together share it as two chats do, when the router pairs them by its cost estimate,
which a loaded machine can tip the other way: test_prefix_reuse.py has that test for chats.)"""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.serve.helpers import chat_turn, user

pytestmark = pytest.mark.timeout(300)

INSTRUCTIONS = "You are a careful assistant. " * 54  # 1,566 characters: about as many tokens here
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", **WEATHER}]  # the same tool in the Responses API's flat form


def _salt() -> str:
    return f"resp-prefix-{uuid.uuid4().hex[:8]}"


async def _respond(client: openai.AsyncOpenAI, model: str, salt: str, text: str, *,
                   instructions: str = INSTRUCTIONS, **kw):
    return await client.responses.create(model=model, instructions=instructions, input=text, tools=RESPONSES_TOOLS,
                                         max_output_tokens=8, temperature=0, extra_body={"cache_salt": salt}, **kw)


def _cached(response) -> int:
    return response.usage.input_tokens_details.cached_tokens


def _output(response) -> list[tuple]:
    """What a response said: each item's kind and text or call (ids differ between runs)."""
    return [(i.type, getattr(i, "name", None), getattr(i, "arguments", None),
             "".join(c.text for c in i.content) if i.type == "message" else None) for i in response.output]


async def _assert_exact(client: openai.AsyncOpenAI, model: str, response, text: str, instructions: str) -> None:
    """The response is the one computed from scratch (a salt of its own, nothing stored)."""
    reference = await _respond(client, model, f"reference-{uuid.uuid4().hex}", text, instructions=instructions,
                               store=False)
    assert _cached(reference) == 0 and reference.usage.input_tokens == response.usage.input_tokens
    assert _output(response) == _output(reference) and response.usage.output_tokens == reference.usage.output_tokens


async def test_a_first_response_reuses_what_an_earlier_request_of_its_salt_computed(stack):
    """A chat opens a conversation with the instructions and the tools; a second chat and then a
    Responses request open theirs: both reuse the same prefix."""
    client, salt = stack.client(), _salt()
    system = {"role": "system", "content": INSTRUCTIONS}
    first = await chat_turn(client, stack.model, [system, user("question 0")], conversation_id=f"c-{uuid.uuid4().hex}",
                            cache_salt=salt, tools=CHAT_TOOLS)
    chat = await chat_turn(client, stack.model, [system, user("question 1")], conversation_id=f"c-{uuid.uuid4().hex}",
                           cache_salt=salt, tools=CHAT_TOOLS)
    response = await _respond(client, stack.model, salt, "question 2")
    assert first.cached_tokens == 0 and chat.cached_tokens >= len(INSTRUCTIONS)
    assert _cached(response) == chat.cached_tokens, (chat.cached_tokens, _cached(response))
    assert response.conversation is not None  # stored: a new conversation, as the chat's
    again = await _respond(client, stack.model, salt, "question 3")  # after a Responses request too
    assert _cached(again) == chat.cached_tokens
    await _assert_exact(client, stack.model, response, "question 2", INSTRUCTIONS)


async def test_another_salt_or_api_key_reuses_nothing(stack, notier):
    client, salt = stack.client(), _salt()
    await _respond(client, stack.model, salt, "question 0")
    mine = await _respond(client, stack.model, salt, "question 1")
    other = await _respond(client, stack.model, _salt(), "question 1")
    assert _cached(mine) >= len(INSTRUCTIONS) and _cached(other) == 0
    await _assert_exact(client, stack.model, other, "question 1", INSTRUCTIONS)
    k1, k2 = (openai.AsyncOpenAI(base_url=f"{stack.base_url}{notier}/v1", api_key=key, max_retries=0, timeout=120)
              for key in ("k1", "k2"))
    await _respond(k1, stack.model, salt, "question 0")
    assert _cached(await _respond(k2, stack.model, salt, "question 1")) == 0  # the same salt, another key
    assert _cached(await _respond(k1, stack.model, salt, "question 1")) >= len(INSTRUCTIONS)
