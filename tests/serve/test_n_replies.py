"""`n` through the official client: n replies of one request (the engine runs the prompt once
and forks the others from it: tests/engine/test_n_choices.py), chat and completions, JSON and
streamed; choice i with `seed` s is the reply of a single request with seed s + i; usage counts
the prompt once and sums the replies; a conversation commits choice 0."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.serve.helpers import conversation, user

pytestmark = pytest.mark.timeout(300)

HI = [user("tell me about hybrid models")]
PROMPT = "Once upon a time, in a land of hybrid models,"
SAMPLED = dict(temperature=1.0, seed=11, max_tokens=6)


def _salt() -> str:
    return f"n-{uuid.uuid4().hex}"


async def test_chat_n_3_each_choice_is_its_seeds_single_reply(stack):
    client = stack.client()
    many = await client.chat.completions.create(model=stack.model, messages=HI, n=3, **SAMPLED,
                                                extra_body={"cache_salt": _salt()})
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [await client.chat.completions.create(model=stack.model, messages=HI, **{**SAMPLED, "seed": 11 + i},
                                                    extra_body={"cache_salt": _salt()}) for i in range(3)]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert [c.finish_reason for c in many.choices] == [s.choices[0].finish_reason for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt, once
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert len({c.message.content for c in many.choices}) > 1


async def test_chat_n_streams_every_index_and_one_finish_reason_each(stack):
    client = stack.client()
    whole = await client.chat.completions.create(model=stack.model, messages=HI, n=3, **SAMPLED,
                                                 extra_body={"cache_salt": _salt()})
    chunks = [c async for c in await client.chat.completions.create(
        model=stack.model, messages=HI, n=3, **SAMPLED, stream=True, stream_options={"include_usage": True},
        extra_body={"cache_salt": _salt()})]
    assert all(len(c.choices) <= 1 for c in chunks)  # each chunk one index
    texts, finished = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                assert choice.index not in finished
                finished[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


async def test_completions_n_3_json_and_streamed(stack):
    client = stack.client()
    many = await client.completions.create(model=stack.model, prompt=PROMPT, n=3, **SAMPLED,
                                           extra_body={"cache_salt": _salt()})
    singles = [await client.completions.create(model=stack.model, prompt=PROMPT, **{**SAMPLED, "seed": 11 + i},
                                               extra_body={"cache_salt": _salt()}) for i in range(3)]
    assert [(c.index, c.text) for c in many.choices] == [(i, s.choices[0].text) for i, s in enumerate(singles)]
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    chunks = [c async for c in await client.completions.create(
        model=stack.model, prompt=PROMPT, n=3, **SAMPLED, stream=True, extra_body={"cache_salt": _salt()})]
    texts, finished = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in many.choices}
    assert finished == {c.index: c.finish_reason for c in many.choices}


async def test_a_conversation_commits_choice_0(stack, conv_id):
    salt = _salt()
    client = stack.client()
    turn = await client.chat.completions.create(model=stack.model, messages=HI, n=2, **SAMPLED,
                                                extra_body={"cache_salt": salt, "conversation_id": conv_id})
    assert turn.choices[0].message.content != turn.choices[1].message.content
    async with stack.http() as http:
        ledger = await conversation(http, conv_id, salt)
    said = [m["content"] for m in ledger["turns"][0]["messages"] if m["role"] == "assistant"]
    assert said == [turn.choices[0].message.content]

@pytest.mark.parametrize("fields", [{"n": 17}, {"n": 2, "extra_body": {"deterministic": True}}], ids=str)
async def test_n_out_of_range_or_deterministic_is_a_400_naming_n(stack, fields):
    with pytest.raises(openai.BadRequestError) as refused:
        await stack.client().chat.completions.create(**{"model": stack.model, "messages": HI, "max_tokens": 2,
                                                        **fields})
    assert refused.value.body["param"] == "n"
