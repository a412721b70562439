"""vLLM's chat-template fields (`add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`), a message's `name`, and `skip_special_tokens` through the app and the
official client: each prompt is checked against a stateless reference built by hand (the
template's text sent as a legacy completion, which runs it as is), bad values are 400s."""

from __future__ import annotations

import shutil
import uuid

import openai
import pytest
from ray import serve

from deployments.app import build_app
from tests.serve.conftest import app_args
from tests.serve.helpers import chat_turn, user
from workers.checkpoint import Arch, Preset, make_model
from workers.checkpoint.chat_template import CHAT_TEMPLATE, GENERATION_PROMPT
from workers.checkpoint.tokens import EOS_TOKEN_ID, SpecialToken

pytestmark = pytest.mark.timeout(300)

EOT = SpecialToken.END_OF_TURN.value
HI = [user("tell me about hybrid models")]
OPENED = [*HI, {"role": "assistant", "content": "Hybrid models"}]
# The built-in template plus what real templates do: a speaker's name after its role, and a
# variable of the render (as Granite's `thinking`) that opens the prompt.
NAMED_TEMPLATE = ("{%- if greeting is defined -%}{{- 'greeting:' + greeting -}}{%- endif -%}"
                  + CHAT_TEMPLATE.replace("+ message['role'] +",
                                          "+ message['role'] + (('/' + message['name']) if message['name'] else '') +"))
NAMED_APP = "hybridserve-named-template"
GENERATION_TOKENS = 2 + len("assistant")  # two special tokens around the role's characters


def _salt() -> str:
    return f"tpl-{uuid.uuid4().hex}"


def rendered(messages: list[dict]) -> str:
    """The built-in template's text of `messages`, by hand (chat_template.py's rule)."""
    return "".join(f"<|start_of_role|>{m['role']}<|end_of_role|>{m['content']}{EOT}" for m in messages)


async def _reply(client, model, messages, **extra):
    return await chat_turn(client, model, messages, conversation_id=None, cache_salt=_salt(), **extra)


async def _completion(client, model, prompt: str, **extra):
    """The reference: the prompt's text as a legacy completion (tokenized as is), greedy."""
    return await client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"cache_salt": _salt(), **extra})


async def _refused(client, model, messages, **extra) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                             extra_body={"cache_salt": _salt(), **extra})
    return refused.value


@pytest.fixture(scope="module")
def named(stack, tmp_path_factory):
    """A second app whose model's template renders names and a `greeting` variable, and whose
    model may write its end-of-turn token (not banned: a reply can end in it)."""
    model_dir = make_model(tmp_path_factory.mktemp("named") / "named-model", Arch.BAMBA, Preset.TINY, seed=4)
    (model_dir / "chat_template.jinja").write_text(NAMED_TEMPLATE)
    serve.run(build_app(app_args(str(model_dir), stack.service, tier_export="off")), name=NAMED_APP,
              route_prefix="/named")
    yield stack.client("/named"), model_dir.name
    serve.delete(NAMED_APP)
    shutil.rmtree(model_dir, ignore_errors=True)


async def test_add_generation_prompt_false_ends_the_prompt_at_the_last_message(stack):
    client = stack.client()
    opened = await _reply(client, stack.model, HI)
    closed = await _reply(client, stack.model, HI, add_generation_prompt=False)
    reference = await _completion(client, stack.model, rendered(HI))
    assert closed.prompt_tokens == reference.usage.prompt_tokens == opened.prompt_tokens - GENERATION_TOKENS
    assert closed.text == reference.choices[0].text != opened.text


async def test_continue_final_message_continues_the_assistant_message(stack):
    client = stack.client()
    cont = await _reply(client, stack.model, OPENED, add_generation_prompt=False, continue_final_message=True)
    reference = await _completion(client, stack.model, rendered(HI) + GENERATION_PROMPT + "Hybrid models")
    assert cont.prompt_tokens == reference.usage.prompt_tokens
    assert cont.text == reference.choices[0].text
    streamed = await chat_turn(client, stack.model, OPENED, conversation_id=None, cache_salt=_salt(), stream=True,
                               add_generation_prompt=False, continue_final_message=True)
    assert streamed.text == cont.text
    async with stack.http() as http:  # /tokenize renders as the request runs
        counted = await http.post("/tokenize", json={"messages": OPENED, "add_generation_prompt": False,
                                                     "continue_final_message": True})
    assert counted.json()["count"] == cont.prompt_tokens


async def test_template_fields_refused_as_vllm_refuses_them(stack, conv_id):
    client, model = stack.client(), stack.model
    both = await _refused(client, model, OPENED, continue_final_message=True)  # add_generation_prompt defaults true
    assert "Cannot set both" in both.message and both.body["param"] == "continue_final_message"
    not_assistant = await _refused(client, model, HI, add_generation_prompt=False, continue_final_message=True)
    assert "assistant" in not_assistant.message
    for key in ("tools", "messages", "add_generation_prompt", "chat_template", "eos_token"):
        reserved = await _refused(client, model, HI, chat_template_kwargs={key: 1})
        assert reserved.body["param"] == "chat_template_kwargs" and key in reserved.message
    await _refused(client, model, HI, chat_template_kwargs=["greeting"])
    await _refused(client, model, HI, skip_special_tokens="no")
    # A conversation's reply is committed as a new assistant message: its prompt must open one.
    for fields in ({"add_generation_prompt": False},
                   {"add_generation_prompt": False, "continue_final_message": True}):
        refused = await _refused(client, model, OPENED, conversation_id=conv_id, **fields)
        assert "conversation" in refused.message and refused.body["param"] in fields


async def test_names_and_kwargs_reach_the_template(named):
    client, model = named
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi", "name": "ada"}]
    reply = await _reply(client, model, messages, chat_template_kwargs={"greeting": "hello"})
    by_hand = ("greeting:hello<|start_of_role|>system<|end_of_role|>be brief" + EOT
               + "<|start_of_role|>user/ada<|end_of_role|>hi" + EOT + GENERATION_PROMPT)
    reference = await _completion(client, model, by_hand)
    assert reply.prompt_tokens == reference.usage.prompt_tokens
    assert reply.text == reference.choices[0].text
    plain = await _reply(client, model, [messages[0], {"role": "user", "content": "hi"}])
    assert plain.prompt_tokens == reply.prompt_tokens - len("greeting:hello") - len("/ada")


async def test_a_conversation_renders_its_history_with_the_kwargs(named):
    client, model = named
    conv, salt, kwargs = f"c-{uuid.uuid4().hex}", _salt(), {"greeting": "hello"}
    first = await chat_turn(client, model, HI, conversation_id=conv, cache_salt=salt, chat_template_kwargs=kwargs)
    second = [user("and then?")]
    nxt = await chat_turn(client, model, second, conversation_id=conv, cache_salt=salt, chat_template_kwargs=kwargs)
    history = [*HI, {"role": "assistant", "content": first.text}, *second]
    reference = await _reply(client, model, history, chat_template_kwargs=kwargs)
    assert nxt.prompt_tokens == reference.prompt_tokens and nxt.text == reference.text
    assert nxt.cached_tokens > 0  # the head was reused
    with pytest.raises(openai.BadRequestError):  # without the kwargs the history renders otherwise
        await chat_turn(client, model, second, conversation_id=conv, cache_salt=salt)


async def test_skip_special_tokens_false_keeps_them_in_the_text(named):
    client, model = named
    forced = {"logit_bias": {str(EOS_TOKEN_ID): 100}, "ignore_eos": True}  # every token the end of turn
    skipped = await _reply(client, model, HI, max_tokens=3, **forced)
    kept = await _reply(client, model, HI, max_tokens=3, skip_special_tokens=False, **forced)
    assert skipped.text == "" and kept.text == EOT * 3
    ended = await _reply(client, model, HI, max_tokens=3, skip_special_tokens=False, logit_bias=forced["logit_bias"])
    assert ended.finish_reason == "stop" and ended.text == ""  # the end of turn that ends it: not text (vLLM's)
    spaced = await _reply(client, model, HI, max_tokens=3, skip_special_tokens=False,
                          spaces_between_special_tokens=False, **forced)
    assert spaced.text == kept.text  # this tokenizer's decoder joins tokens without spaces
    completion = await _completion(client, model, "hi", skip_special_tokens=False, **forced)
    assert completion.choices[0].text == EOT * 8
    streamed = await chat_turn(client, model, HI, conversation_id=None, cache_salt=_salt(), stream=True,
                               max_tokens=3, skip_special_tokens=False, **forced)
    assert streamed.text == EOT * 3
