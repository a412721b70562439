"""OpenAI's presence_penalty, frequency_penalty and logit_bias, vLLM's repetition_penalty and
min_tokens, through the app and the official client: each changes the reply as documented, on
chat and completions, greedy and deterministic; a bad value is a 400 naming the field."""

from __future__ import annotations

import uuid

import openai
import pytest
from transformers import AutoTokenizer

from tests.serve.helpers import chat_turn, user

pytestmark = pytest.mark.timeout(300)

HI = [user("tell me about hybrid models")]


def _salt() -> str:
    return f"fields-{uuid.uuid4().hex}"


async def _reply(stack, messages=HI, **extra):
    return await chat_turn(stack.client(), stack.model, messages, conversation_id=None, cache_salt=_salt(), **extra)


@pytest.fixture(scope="module")
def token_id(stack):
    tokenizer = AutoTokenizer.from_pretrained(stack.model_dir)
    return tokenizer.convert_tokens_to_ids


async def test_a_large_negative_logit_bias_changes_the_first_greedy_token(stack, token_id):
    greedy = await _reply(stack)
    first = token_id(greedy.tokens[0])
    client = stack.client()
    biased = await client.chat.completions.create(model=stack.model, messages=HI, max_tokens=4, temperature=0,
                                                  logprobs=True, logit_bias={str(first): -100},
                                                  extra_body={"cache_salt": _salt()})
    assert biased.choices[0].logprobs.content[0].token != greedy.tokens[0]
    forced = await client.completions.create(model=stack.model, prompt="hybrid", max_tokens=3, temperature=0,
                                             logprobs=0, logit_bias={str(first): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].logprobs.tokens == [greedy.tokens[0]] * 3


async def test_a_strong_frequency_penalty_changes_a_greedy_reply_that_repeats(stack):
    greedy = await _reply(stack, max_tokens=32, ignore_eos=True)
    assert len(set(greedy.tokens)) < len(greedy.tokens)  # it repeats a token
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        penalized = await _reply(stack, max_tokens=32, ignore_eos=True, **penalty)
        assert penalized.tokens != greedy.tokens, penalty
        assert penalized.tokens[0] == greedy.tokens[0] or "repetition_penalty" in penalty  # nothing generated yet
    deterministic = await _reply(stack, max_tokens=32, ignore_eos=True, frequency_penalty=2.0, deterministic=True)
    assert deterministic.tokens != greedy.tokens
    completion = await stack.client().completions.create(model=stack.model, prompt="hybrid models", max_tokens=24,
                                                         temperature=0, frequency_penalty=2.0,
                                                         extra_body={"ignore_eos": True})
    plain = await stack.client().completions.create(model=stack.model, prompt="hybrid models", max_tokens=24,
                                                    temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text != plain.choices[0].text


async def test_min_tokens_holds_back_a_stop_token_id(stack, token_id):
    greedy = await _reply(stack, max_tokens=16, ignore_eos=True)
    stop = token_id(greedy.tokens[1])
    stopped = await _reply(stack, max_tokens=16, stop_token_ids=[stop])
    assert stopped.finish_reason == "stop" and len(stopped.tokens) <= 2
    held = await _reply(stack, max_tokens=16, stop_token_ids=[stop], min_tokens=6)
    assert len(held.tokens) >= 6 and stop not in [token_id(t) for t in held.tokens[:6]]


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens"),  # more than max_tokens
], ids=lambda f: str(f))
async def test_a_bad_value_is_a_400_naming_the_field(stack, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        await stack.client().chat.completions.create(model=stack.model, messages=HI, max_tokens=8, **fields)
    body = refused.value.body
    assert body["param"].split(".")[0] == param and body["code"] == "invalid_request"  # served, this value is not


async def test_logit_bias_outside_the_vocabulary_is_a_400(stack):
    with pytest.raises(openai.BadRequestError) as refused:
        await stack.client().chat.completions.create(model=stack.model, messages=HI, max_tokens=2,
                                                     logit_bias={"99999999": 5})
    assert "logit_bias" in refused.value.body["message"] and "vocabulary" in refused.value.body["message"]
