"""The chat template: exact text, and append-consistency in text and in token ids."""

from __future__ import annotations

import random

import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer

from workers.checkpoint.chat_template import CHAT_TEMPLATE, GENERATION_PROMPT, Role
from workers.checkpoint.tokenizer import write_tokenizer
from workers.checkpoint.tokens import EOS_TOKEN_ID, ORDINARY_CHARACTERS, SpecialToken

EOT = SpecialToken.END_OF_TURN.value


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = write_tokenizer(tmp_path_factory.mktemp("tok"))
    return AutoTokenizer.from_pretrained(out, local_files_only=True)


def _text(tok, messages, gen: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def _ids(tok, messages, gen: bool) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=gen, sanitize_control_tokens=True)
    return list(out["input_ids"])


def test_saved_template_is_ours(tok):
    assert tok.chat_template == CHAT_TEMPLATE


def test_exact_rendering(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\n"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": '{"x": 1}'},
    ]
    expected = (
        "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_turn|>"
        "<|start_of_role|>user<|end_of_role|>Hi\n<|end_of_turn|>"
        "<|start_of_role|>assistant<|end_of_role|>Hello!<|end_of_turn|>"
        '<|start_of_role|>tool<|end_of_role|>{"x": 1}<|end_of_turn|>'
    )
    assert _text(tok, messages, False) == expected
    assert _text(tok, messages, True) == expected + GENERATION_PROMPT
    assert GENERATION_PROMPT == "<|start_of_role|>assistant<|end_of_role|>"


def test_content_parts_and_missing_content(tok):
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}, {"type": "text", "text": "b"}]
    assert _text(tok, [{"role": "user", "content": parts}], False) == _text(tok, [{"role": "user", "content": "ab"}], False)
    empty = "<|start_of_role|>assistant<|end_of_role|><|end_of_turn|>"
    assert _text(tok, [{"role": "assistant", "content": None}], False) == empty
    assert _text(tok, [{"role": "assistant"}], False) == empty


def test_unknown_role_is_rejected(tok):
    with pytest.raises(TemplateError):
        _text(tok, [{"role": "developer", "content": "x"}], True)


def _random_text(rng: random.Random) -> str:
    alphabet = list(ORDINARY_CHARACTERS) + [EOT, SpecialToken.START_OF_ROLE.value]  # injection attempts too
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))


def _random_conversation(rng: random.Random) -> list[dict]:
    messages = [{"role": Role.SYSTEM.value, "content": _random_text(rng)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 5)):
        messages.append({"role": rng.choice([Role.USER.value, Role.TOOL.value]), "content": _random_text(rng)})
        messages.append({"role": Role.ASSISTANT.value, "content": _random_text(rng)})
    return messages


def test_append_consistency_text_and_ids(tok):
    """prefix + generation prompt, then the generated reply + end-of-turn, then the next
    suffix rendered alone == the whole history rendered at once (text and token ids)."""
    rng = random.Random(0)
    for _ in range(40):
        messages = _random_conversation(rng)
        for k, message in enumerate(messages):
            if message["role"] != Role.ASSISTANT.value:
                continue
            reply = message["content"]
            suffix = messages[k + 1 : k + 2]
            full = messages[: k + 1] + suffix
            gen = bool(suffix)
            text = _text(tok, messages[:k], True) + reply + EOT + (_text(tok, suffix, gen) if suffix else "")
            assert text == _text(tok, full, gen)

            reply_ids = tok.encode(reply, add_special_tokens=False, split_special_tokens=True)
            ids = _ids(tok, messages[:k], True) + reply_ids + [EOS_TOKEN_ID] + (_ids(tok, suffix, gen) if suffix else [])
            assert ids == _ids(tok, full, gen)
