"""Legacy completions (`POST /v1/completions`) through the official client: text or token-id
prompts give the same reply, streaming gives what the JSON answer gives, logprobs in the legacy
shape, echo, prefix reuse as a stateless chat gets, and what is not served is a 400 by name."""

from __future__ import annotations

import uuid

import openai
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(300)

PROMPT = "Once upon a time, in a land of hybrid models,"


def _salt() -> str:
    return f"completions-{uuid.uuid4().hex}"


async def test_text_and_token_ids_prompts_stream_and_logprobs(stack):
    client = stack.client()
    salt = _salt()
    ids = AutoTokenizer.from_pretrained(stack.model_dir).encode(PROMPT, add_special_tokens=False)
    same = dict(model=stack.model, max_tokens=5, temperature=0, logprobs=2)
    text = await client.completions.create(prompt=PROMPT, **same, extra_body={"cache_salt": salt})
    choice = text.choices[0]
    assert text.object == "text_completion" and choice.finish_reason == "length"
    assert text.usage.prompt_tokens == len(ids) and text.usage.completion_tokens == 5
    assert len(choice.logprobs.tokens) == 5 and "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) == 2 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))
    assert choice.logprobs.text_offset == [sum(map(len, choice.logprobs.tokens[:i])) for i in range(5)]

    # The same prompt again under the same salt: the state before its last token was kept, as a
    # stateless chat's message boundaries are, and the prefix index routes the repeat to it.
    again = await client.completions.create(prompt=PROMPT, **same, extra_body={"cache_salt": salt})
    assert again.choices[0].text == choice.text
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    as_ids = await client.completions.create(prompt=ids, **same, extra_body={"cache_salt": _salt()})
    assert as_ids.choices[0].text == choice.text and as_ids.usage.prompt_tokens == len(ids)

    chunks = [c async for c in await client.completions.create(
        prompt=[PROMPT], **same, stream=True, stream_options={"include_usage": True},
        extra_body={"cache_salt": _salt()})]
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert [lp for c in streamed if c.logprobs for lp in c.logprobs.token_logprobs] == \
        pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)  # float rounding: a neighbour changes chunks
    assert streamed[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5


async def test_echo_and_the_default_length(stack):
    client = stack.client()
    echoed = await client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=3, echo=True,
                                             extra_body={"cache_salt": _salt()})
    assert echoed.choices[0].text.startswith(PROMPT) and echoed.usage.completion_tokens == 3
    default = await client.completions.create(model=stack.model, prompt=PROMPT, extra_body={"cache_salt": _salt()})
    assert default.usage.completion_tokens == 16  # OpenAI's and vLLM's default for completions


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ["one", "two"]}, "prompt"), ({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"extra_body": {"min_tokens": 5}}, "min_tokens"),
], ids=lambda f: str(f))
async def test_what_is_not_served_is_a_400_naming_it(stack, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        await stack.client().completions.create(**{"model": stack.model, "prompt": PROMPT, "max_tokens": 2, **fields})
    assert refused.value.body["param"].split(".")[0] == param  # logit_bias.<id>: the entry
