"""vLLM's rendering fields on the real tokenizer: chat_template_kwargs and a message's `name`
reach the template, add_generation_prompt and continue_final_message shape the prompt's end,
and skip_special_tokens=False keeps the reply's special tokens in its text."""

from __future__ import annotations

import pytest

from workers.checkpoint.chat_template import CHAT_TEMPLATE, GENERATION_PROMPT
from workers.checkpoint.tokenizer import write_tokenizer
from workers.checkpoint.tokens import EOS_TOKEN_ID, SpecialToken
from workers.conversation.prompt import build_turn_prompt
from workers.detokenizer import Detokenizer, FullDecodeDetokenizer, detokenizer_for
from workers.sampling import SamplingParams
from workers.template_options import TemplateOptions
from workers.tokenizer import ChatTokenizer

EOT = SpecialToken.END_OF_TURN.value
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
# The built-in template with two additions real templates make: a speaker's name after its
# role, and a variable of the render (e.g. Granite's `thinking`) that opens the prompt.
NAMED_TEMPLATE = ("{%- if greeting is defined -%}{{- 'greeting:' + greeting -}}{%- endif -%}"
                  + CHAT_TEMPLATE.replace("+ message['role'] +",
                                          "+ message['role'] + (('/' + message['name']) if message['name'] else '') +"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> ChatTokenizer:
    return ChatTokenizer(write_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def named(tmp_path_factory) -> ChatTokenizer:
    out = write_tokenizer(tmp_path_factory.mktemp("named"))
    assert NAMED_TEMPLATE != CHAT_TEMPLATE
    (out / "chat_template.jinja").write_text(NAMED_TEMPLATE)
    return ChatTokenizer(out)


def test_add_generation_prompt_false_ends_at_the_last_message(tokenizer):
    plain = tokenizer.render(CHAT[:1], template=TemplateOptions(add_generation_prompt=False))
    assert plain == f"<|start_of_role|>user<|end_of_role|>Hi{EOT}"
    assert tokenizer.render(CHAT[:1]) == plain + GENERATION_PROMPT


def test_continue_final_message_leaves_the_assistant_message_open(tokenizer):
    options = TemplateOptions(add_generation_prompt=False, continue_final_message=True)
    closed = tokenizer.render(CHAT, template=TemplateOptions(add_generation_prompt=False))
    assert tokenizer.render(CHAT, template=options) == closed[: -len(EOT)]
    assert tokenizer.render(CHAT, template=options).endswith(f"{GENERATION_PROMPT}Hel")
    prompt = build_turn_prompt(tokenizer, [], [], CHAT, template=options).token_ids
    assert tokenizer.decode_exact(prompt) == closed[: -len(EOT)]


def test_kwargs_and_names_reach_the_template(named):
    messages = [{"role": "user", "content": "Hi", "name": "ada"}]
    assert named.render(messages).startswith("<|start_of_role|>user/ada<|end_of_role|>Hi")
    greeted = named.render(messages, template=TemplateOptions(kwargs={"greeting": "hello"}))
    assert greeted == "greeting:hello" + named.render(messages)


def test_a_conversation_turn_renders_its_history_with_the_kwargs(named):
    kwargs = TemplateOptions(kwargs={"greeting": "hello"})
    first = build_turn_prompt(named, [], [], CHAT[:1], template=kwargs).token_ids
    committed = first + named.encode("Hello" + EOT)
    history = [*CHAT[:1], {"role": "assistant", "content": "Hello"}]
    nxt = build_turn_prompt(named, committed, history, [{"role": "user", "content": "Again"}], template=kwargs)
    assert named.decode_exact(nxt.token_ids) == named.render([*history, {"role": "user", "content": "Again"}],
                                                             template=kwargs)


@pytest.mark.parametrize("kind", [Detokenizer, FullDecodeDetokenizer])
def test_skip_special_tokens_false_keeps_them_in_the_text(tokenizer, kind):
    ids = tokenizer.encode("ok") + [EOS_TOKEN_ID] + tokenizer.encode("x")
    for skip, expected in ((True, "okx"), (False, f"ok{EOT}x")):
        detok = kind(tokenizer, (), 0, skip_special_tokens=skip)
        text = "".join(detok.update(i)[0] for i in ids) + detok.flush()
        assert text == expected


def test_the_request_params_choose_the_detokenizer(tokenizer):
    kept = detokenizer_for(tokenizer, SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False))
    assert kept.update(EOS_TOKEN_ID)[0] == EOT
    assert detokenizer_for(tokenizer, SamplingParams()).update(EOS_TOKEN_ID)[0] == ""
