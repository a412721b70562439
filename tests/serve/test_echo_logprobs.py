"""Completions' `echo` with `logprobs` (what lm-eval's log-likelihood tasks send) and vLLM's
`prompt_logprobs`, through the official client and as lm-eval posts and parses them: the prompt's
per-token logprobs equal transformers' full forward's log_softmax on the served checkpoint."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.timeout(300)

PROMPT = "The hybrid model reads the prompt, and then"
TOL = 1e-4  # fp32 on the CPU


@pytest.fixture(scope="module")
def reference(stack):
    tokenizer = AutoTokenizer.from_pretrained(stack.model_dir)
    model = AutoModelForCausalLM.from_pretrained(stack.model_dir, local_files_only=True, dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(ids: list[int]) -> torch.Tensor:
        """Row p: log_softmax of the logits predicting token p + 1."""
        return torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0].float(), dim=-1)

    return tokenizer, logprobs


def _salt() -> dict:
    return {"cache_salt": f"echo-{uuid.uuid4().hex}"}


def _expected(logprobs: torch.Tensor, ids: list[int]) -> list[float]:
    return [float(logprobs[p, ids[p + 1]]) for p in range(len(ids) - 1)]


async def test_echo_with_logprobs_and_no_reply_text_and_ids(stack, reference):
    tokenizer, forward = reference
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    expected = _expected(forward(ids), ids)
    client = stack.client()
    by_text = await client.completions.create(model=stack.model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0,
                                              temperature=0, extra_body=_salt())
    by_ids = await client.completions.create(model=stack.model, prompt=ids, echo=True, logprobs=1, max_tokens=0,
                                             temperature=0, extra_body=_salt())
    for answer, text in ((by_text, PROMPT), (by_ids, tokenizer.decode(ids))):
        choice = answer.choices[0]
        assert choice.text == text and choice.finish_reason == "length"
        assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(ids)
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=TOL)
        assert lp.tokens == [tokenizer.decode([i]) for i in ids]
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
        # each top_logprobs dict: the prompt token and the likeliest one (the same when it was greedy)
        assert all(token in top and 1 <= len(top) <= 2 for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))


async def test_echo_then_the_reply_and_streamed(stack, reference):
    tokenizer, forward = reference
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    client = stack.client()
    same = dict(model=stack.model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    answer = (await client.completions.create(**same, extra_body=_salt())).choices[0]
    lp = answer.logprobs
    assert len(lp.tokens) == len(ids) + 3 and answer.text.startswith(PROMPT)
    reply = lp.tokens[len(ids):]
    assert answer.text == PROMPT + "".join(reply)
    assert lp.text_offset[len(ids):] == [len(PROMPT) + sum(map(len, reply[:i])) for i in range(3)]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(_expected(forward(ids), ids), abs=TOL)

    chunks = [c.choices[0] async for c in await client.completions.create(**same, stream=True, extra_body=_salt())
              if c.choices]
    assert chunks[0].text == PROMPT and chunks[0].logprobs.tokens == lp.tokens[:len(ids)]
    assert "".join(c.text for c in chunks) == answer.text
    streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=TOL)


async def test_vllm_prompt_logprobs_field_on_completions_and_chat(stack, reference):
    tokenizer, forward = reference
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    logprobs = forward(ids)
    client = stack.client()
    answer = await client.completions.create(model=stack.model, prompt=ids, max_tokens=1, temperature=0,
                                             extra_body={"prompt_logprobs": 2, **_salt()})
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for p, step in enumerate(entries[1:]):
        mine = step[str(ids[p + 1])]
        assert mine["logprob"] == pytest.approx(float(logprobs[p, ids[p + 1]]), abs=TOL)
        assert mine["rank"] == int((logprobs[p] > logprobs[p, ids[p + 1]]).sum()) + 1
        top = sorted(step.values(), key=lambda e: e["rank"])[0]
        assert top["rank"] == 1 and top["logprob"] == pytest.approx(float(logprobs[p].max()), abs=TOL)

    chat = await client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=1, extra_body={"prompt_logprobs": 0, **_salt()})
    prompt = chat.model_extra["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == chat.usage.prompt_tokens and all(len(s) == 1 for s in prompt[1:])


async def test_n_choices_each_echo_the_prompt_with_its_logprobs(stack, reference):
    """n > 1: the prompt is every choice's, its logprobs computed once: each choice opens with it
    (and its logprobs, and `prompt_logprobs`), JSON and streamed; chat's `prompt_logprobs` once."""
    tokenizer, forward = reference
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    expected = _expected(forward(ids), ids)
    client = stack.client()
    same = dict(model=stack.model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, n=3, temperature=1.0, seed=5)
    answer = await client.completions.create(**same, extra_body={"prompt_logprobs": 0, **_salt()})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        lp = choice.logprobs
        assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 3
        assert lp.token_logprobs[0] is None and lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=TOL)
        assert choice.text == PROMPT + "".join(lp.tokens[len(ids):])
        vllm = choice.model_extra["prompt_logprobs"]
        assert vllm[0] is None and [s[str(t)]["logprob"] for s, t in zip(vllm[1:], ids[1:])] == pytest.approx(
            expected, abs=TOL)
    assert len({c.text for c in answer.choices}) > 1  # the replies differ, the prompt part does not

    chunks = [c.choices[0] async for c in await client.completions.create(**same, stream=True, extra_body=_salt())
              if c.choices]
    texts, streamed = {}, {}
    for chunk in chunks:
        texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
        streamed.setdefault(chunk.index, []).extend(chunk.logprobs.token_logprobs if chunk.logprobs else ())
    assert texts == {c.index: c.text for c in answer.choices}  # the same seeds: the same replies
    for index, logprobs in streamed.items():
        assert logprobs[0] is None and logprobs[1:len(ids)] == pytest.approx(expected, abs=TOL), index

    alone = await client.completions.create(**{**same, "max_tokens": 0}, extra_body=_salt())
    assert [c.text for c in alone.choices] == [PROMPT] * 3 and alone.usage.completion_tokens == 0
    assert all(c.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=TOL) for c in alone.choices)

    chat = await client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=2, n=2, extra_body={"prompt_logprobs": 0, **_salt()})
    prompt = chat.model_extra["prompt_logprobs"]
    assert len(chat.choices) == 2 and prompt[0] is None and len(prompt) == chat.usage.prompt_tokens


@pytest.mark.parametrize("refused, accepted, param", [
    ({"max_tokens": 0}, {"max_tokens": 0, "echo": True}, "max_tokens"),
    ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, {"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": 21}}, {"extra_body": {"prompt_logprobs": 20}}, "prompt_logprobs"),
], ids=str)
async def test_what_echo_and_prompt_logprobs_refuse_beside_what_they_take(stack, refused, accepted, param):
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(**{"model": stack.model, "prompt": PROMPT, "max_tokens": 2, **refused})
    assert error.value.body["param"] == param
    answer = await client.completions.create(**{"model": stack.model, "prompt": PROMPT, "max_tokens": 2, **accepted})
    assert answer.choices[0].text.startswith(PROMPT) or answer.choices[0].model_extra["prompt_logprobs"][0] is None


async def test_lm_eval_loglikelihood_request_and_parsing(stack, reference):
    """lm-eval's local-completions, its request and its parse_logprobs reproduced: a context and
    a continuation as token ids, echo, logprobs 1, max_tokens 1; the continuation's summed
    logprob and whether it is greedy, for a greedy continuation and a non-greedy one."""
    tokenizer, forward = reference
    context = tokenizer.encode("Question: what runs the prompt? Answer:", add_special_tokens=False)
    row = forward(context)[-1]
    greedy, other = int(row.argmax()), int(row.argsort()[-5])
    task = [(context, [greedy]), (context, [other, greedy])]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        for ctx, continuation in task:
            ids = ctx + continuation
            reply = await http.post("/v1/completions", json={
                "model": stack.model, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                "seed": 1234, "echo": True})
            assert reply.status_code == 200, reply.text
            choice = sorted(reply.json()["choices"], key=lambda c: c["index"])[0]
            ctxlen = len(ctx)
            token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]  # lm-eval's slice
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs))
            expected = _expected(forward(ids), ids)[ctxlen - 1:]
            assert sum(token_logprobs) == pytest.approx(sum(expected), abs=len(expected) * TOL)
            assert is_greedy == (continuation == [greedy])
