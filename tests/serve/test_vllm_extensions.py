"""vLLM's request extensions that are served, through the official client (`extra_body`), each
shown changing the reply the way vLLM documents; what agent frameworks resend is accepted; a
vLLM field not served is still a 400 naming it."""

from __future__ import annotations

import uuid

import openai
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from deployments.front import vllm_fields
from deployments.front.chat_models import ChatCompletionRequest
from deployments.settings import UnknownFields
from tests.serve.helpers import chat_turn, user

pytestmark = pytest.mark.timeout(300)

HI = [user("tell me about hybrid models")]


def _salt() -> str:
    return f"ext-{uuid.uuid4().hex}"


async def _reply(stack, messages=HI, **extra):
    return await chat_turn(stack.client(), stack.model, messages, conversation_id=None, cache_salt=_salt(), **extra)


def served(reply) -> tuple:
    """What two requests asking for the same reply must agree on: its tokens and how it ended. Not
    its logprobs' last bits: outside deterministic mode, a request another runs beside (a stream
    an earlier test closed, still being cancelled) is prefilled in other chunks (DETERMINISM.md)."""
    return reply.text, reply.tokens, reply.finish_reason, reply.prompt_tokens


async def test_top_k_1_and_min_p_1_sample_the_greedy_reply(stack):
    greedy = await _reply(stack, temperature=0)
    sampled = await _reply(stack, temperature=1.0, seed=3)
    assert sampled.text != greedy.text  # the seed's draw is not the greedy one
    assert (await _reply(stack, temperature=1.0, seed=3, top_k=1)).text == greedy.text
    assert (await _reply(stack, temperature=1.0, seed=3, min_p=1.0)).text == greedy.text
    assert (await _reply(stack, temperature=1.0, seed=3, top_k=-1, min_p=0)).text == sampled.text  # off


async def test_stop_token_ids_end_the_reply_at_the_first_one(stack):
    greedy = await _reply(stack, temperature=0)
    stop_id = AutoTokenizer.from_pretrained(stack.model_dir).convert_tokens_to_ids(greedy.tokens[3])
    first = greedy.tokens.index(greedy.tokens[3])
    stopped = await _reply(stack, temperature=0, stop_token_ids=[stop_id], ignore_eos=True)
    assert stopped.finish_reason == "stop" and stopped.tokens == greedy.tokens[:first + 1]
    # Its text is left out of the reply unless asked for, as vLLM's server does (bench.vllm_parity)
    included = await _reply(stack, temperature=0, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert stopped.text == "".join(greedy.tokens[:first]) and included.text == "".join(greedy.tokens[:first + 1])


async def test_request_id_names_the_reply(stack):
    reply = await stack.client().chat.completions.create(model=stack.model, messages=HI, max_tokens=2,
                                                         extra_body={"request_id": "trace-7", "cache_salt": _salt()})
    assert reply.id == "chatcmpl-trace-7"


async def test_text_parts_join_with_a_newline_and_developer_is_system(stack):
    parts = [{"type": "text", "text": "first line", "cache_control": {"type": "ephemeral"}},
             {"type": "text", "text": "second line"}]
    joined = await _reply(stack, [user("first line\nsecond line")], temperature=0)
    assert served(await _reply(stack, [{"role": "user", "content": parts}], temperature=0)) == served(joined)
    system = await _reply(stack, [{"role": "system", "content": "be brief"}, *HI], temperature=0)
    developer = await _reply(stack, [{"role": "developer", "content": "be brief"}, *HI], temperature=0)
    assert served(developer) == served(system)


async def test_resent_tool_call_index_is_accepted(stack):
    history = [user("weather?"), {"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert (await _reply(stack, history, temperature=0)).finish_reason == "length"


@pytest.mark.parametrize("field", [{"length_penalty": 1.2}, {"use_beam_search": True}, {"bad_words": ["x"]}],
                         ids=lambda f: next(iter(f)))
async def test_a_vllm_field_not_served_is_a_400_naming_it(stack, field):
    with pytest.raises(openai.BadRequestError) as refused:
        await _reply(stack, **field)
    assert refused.value.body["param"] == next(iter(field))


async def test_vllm_fields_at_their_defaults_ask_for_nothing(stack):
    plain = await _reply(stack, temperature=0)
    defaults = await _reply(stack, temperature=0, repetition_penalty=1.0, skip_special_tokens=True, min_tokens=0,
                            include_stop_str_in_output=False, priority=0, chat_template_kwargs={})
    assert served(defaults) == served(plain)


def test_unknown_fields_are_refused_unless_the_deployment_follows_vllm(monkeypatch):
    body = {"model": "m", "messages": [user("hi")], "no_such_field": 1}
    with pytest.raises(ValidationError, match="no_such_field"):
        ChatCompletionRequest.model_validate(body)
    monkeypatch.setattr(vllm_fields.Leniency, "unknown_fields", UnknownFields.LOG)
    assert "no_such_field" not in ChatCompletionRequest.model_validate(body).model_dump()
    with pytest.raises(ValidationError, match="length_penalty"):  # a vLLM field not served: still refused
        ChatCompletionRequest.model_validate({**body, "length_penalty": 1.2})
