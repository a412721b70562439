"""Endpoints clients call the way their own docs show, with the official SDK unchanged:
conversations without a cache_salt (the default scope), a response's cancel, /version, and
vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import uuid

import openai
import pytest
from transformers import AutoTokenizer

from tests.serve.helpers import user

pytestmark = pytest.mark.timeout(300)


async def test_conversations_without_a_cache_salt_use_the_default_scope(stack):
    client = stack.client()
    conv = await client.conversations.create()
    first = await client.responses.create(model=stack.model, input="remember", max_output_tokens=4,
                                          conversation=conv.id)
    assert (await client.conversations.retrieve(conv.id)).id == conv.id
    items = await client.conversations.items.list(conv.id, order="asc")
    assert [item.role for item in items.data] == ["user", "assistant"]
    with pytest.raises(openai.NotFoundError):  # another scope holds no such conversation
        await client.conversations.retrieve(conv.id, extra_query={"cache_salt": "another"})
    assert (await client.conversations.delete(conv.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)


async def test_cancel_is_refused_as_openai_refuses_a_response_not_in_the_background(stack):
    client = stack.client()
    done = await client.responses.create(model=stack.model, input="quick", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        await client.responses.cancel(done.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("resp_nothing")


async def test_version(stack):
    async with stack.http() as http:
        version = await http.get("/version")
    assert version.status_code == 200 and version.json()["version"]


async def test_tokenize_and_detokenize_as_vllm_answers(stack):
    ids = AutoTokenizer.from_pretrained(stack.model_dir).encode("hello there", add_special_tokens=False)
    reply = await stack.client().chat.completions.create(model=stack.model, messages=[user("hi")], max_tokens=1,
                                                         extra_body={"cache_salt": uuid.uuid4().hex})
    async with stack.http() as http:
        text = (await http.post("/tokenize", json={"model": stack.model, "prompt": "hello there"})).json()
        assert text["tokens"] == ids and text["count"] == len(ids) and text["max_model_len"] > len(ids)
        chat = (await http.post("/tokenize", json={"messages": [user("hi")]})).json()
        assert chat["count"] == reply.usage.prompt_tokens  # what a chat request of them runs
        assert (await http.post("/detokenize", json={"tokens": ids})).json() == {"prompt": "hello there"}
        both = await http.post("/tokenize", json={"prompt": "x", "messages": [user("x")]})
        assert both.status_code == 400 and both.json()["error"]["type"] == "invalid_request_error"
        assert (await http.post("/detokenize", json={"model": "nope", "tokens": [1]})).status_code == 404
        outside = await http.post("/detokenize", json={"tokens": [1, 10**9]})  # the fuzzer's 500
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
