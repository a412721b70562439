"""OpenAI's defaults, through the official client against the app: a request without max_tokens
gets what the context leaves (no silent cap), a larger one is clamped rather than refused,
explicit `None`s mean "not given", and every served model name is listed, retrievable and served."""

from __future__ import annotations

import uuid

import openai
import pytest

from deployments.front.chat_models import ChatCompletionRequest
from deployments.front.responses_models import ResponsesRequest
from tests.serve.conftest import MAX_OUTPUT_TOKENS, SERVED_NAMES
from tests.serve.helpers import user

pytestmark = pytest.mark.timeout(300)


def _salt() -> str:
    return f"defaults-{uuid.uuid4().hex}"


async def test_every_served_name_is_listed_retrievable_and_served(stack):
    client = stack.client()
    listed = [m.id for m in (await client.models.list()).data]
    assert listed == [*SERVED_NAMES, stack.model]  # the checkpoint's own name last
    cards = [await client.models.retrieve(name) for name in listed]
    assert {c.model_extra["max_model_len"] for c in cards} == {cards[0].model_extra["max_model_len"]}
    assert 0 < cards[0].model_extra["max_model_len"] <= 4096  # the tiny checkpoint's context
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")
    for name in listed:
        reply = await client.chat.completions.create(model=name, messages=[user("hi")], max_tokens=2,
                                                     extra_body={"cache_salt": _salt()})
        assert reply.model == SERVED_NAMES[0]  # the canonical name, whichever the client used


async def test_without_max_tokens_the_reply_gets_what_the_context_leaves(stack):
    client = stack.client()
    limit = (await client.models.retrieve(stack.model)).model_extra["max_model_len"]
    # The character-level tokenizer: about 300 tokens of context left after this prompt, more
    # than the 256 the server once gave a request without max_tokens.
    messages = [user("x" * (limit - 320))]
    replies = [await client.chat.completions.create(model=stack.model, messages=messages, temperature=0,
                                                    extra_body={"cache_salt": _salt(), **extra})
               for extra in ({}, {"max_tokens": 100_000}, {"max_completion_tokens": 50_000})]
    for reply in replies:  # the model never ends a reply here: each runs to the context's end
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == limit - reply.usage.prompt_tokens > 256
    assert len({r.choices[0].message.content for r in replies}) == 1


async def test_explicit_nones_give_the_same_reply_as_leaving_them_out(stack):
    client = stack.client()
    same = dict(model=stack.model, messages=[user("the same reply, please")], max_tokens=6, seed=5)
    omitted = await client.chat.completions.create(**same, extra_body={"cache_salt": _salt()})
    nones = await client.chat.completions.create(
        **same, temperature=None, top_p=None, n=None, stream=None, logprobs=None, top_logprobs=None,
        stream_options=None, stop=None, presence_penalty=None, frequency_penalty=None, logit_bias=None, user=None,
        tools=None, tool_choice=None, parallel_tool_calls=None, response_format=None, metadata=None,
        store=None, reasoning_effort=None, service_tier=None, modalities=None, audio=None, prediction=None,
        extra_body={"cache_salt": _salt(), "deterministic": None, "wait_if_busy": None, "conversation_id": None})
    assert nones.choices[0].message.content == omitted.choices[0].message.content
    assert nones.usage.completion_tokens == omitted.usage.completion_tokens == 6
    streamed_none = await client.chat.completions.create(
        model=stack.model, messages=[user("hi")], max_tokens=2, stream=True, stream_options=None,
        extra_body={"cache_salt": _salt()})
    assert [c async for c in streamed_none]  # stream_options null with stream on: accepted

    kept = dict(model=stack.model, input="the same response", max_output_tokens=6, temperature=0)  # no seed here
    plain = await client.responses.create(**kept, extra_body={"cache_salt": _salt()})
    with_nones = await client.responses.create(
        **kept, top_p=None, instructions=None, tools=None, tool_choice=None, text=None,
        metadata=None, stream=None, store=None, previous_response_id=None, parallel_tool_calls=None,
        extra_body={"cache_salt": _salt(), "deterministic": None})
    assert with_nones.output_text == plain.output_text and with_nones.usage.output_tokens == 6


@pytest.mark.parametrize("asked", [None, 1, 4000, 4001, 10**9])
def test_max_tokens_is_clamped_to_the_server_cap_never_refused(asked):
    # The worker clamps further, to what the context leaves (above); this is the ingress's part.
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [user("hi")], "max_tokens": asked})
    responses = ResponsesRequest.model_validate({"model": "m", "input": "hi", "max_output_tokens": asked})
    expected = min(asked or MAX_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS)
    assert chat.sampling(MAX_OUTPUT_TOKENS)["max_tokens"] == responses.sampling(MAX_OUTPUT_TOKENS)["max_tokens"] \
        == expected
