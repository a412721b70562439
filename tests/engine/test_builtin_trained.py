"""The trained built-in model shipped in the package: our engine's greedy tokens are
transformers', "Hello!" gets an English reply that ends at <|end_of_turn|>, and its BPE
tokenizer gives any text back exactly.
"""

from __future__ import annotations

import json

import pytest

from tests.engine.conftest import Checkpoint, hf_greedy, new_engine, run_engine
from workers.checkpoint.builtin import default_model_dir
from workers.checkpoint.dialogue_corpus import load_conversations, vocabulary, words_of
from workers.checkpoint.tokens import EOS_TOKEN_ID
from workers.model.config import ModelFamily
from workers.request import FinishReason
from workers.sampling import SamplingParams
from workers.tools.formats import FORMATS

PROMPTS = ["Hello!", "How are you?", "What is your favorite food?", "Tell me a joke.", "Do you like sports?"]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def trained() -> Checkpoint:
    return Checkpoint(default_model_dir(), with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(trained):
    return new_engine(trained.path)


def _chat_prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.render_chat([{"role": "user", "content": text}]))


def test_it_is_a_granite_hybrid_both_backends_run(trained):
    model = trained.ours
    assert model.config.family is ModelFamily.GRANITE_MOE_HYBRID
    kinds = [b.mixer.value for b in model.config.blocks]
    assert kinds.count("attention") == 1 and kinds.count("mamba") == len(kinds) - 1
    assert trained.hf.config.hidden_size // trained.hf.config.num_attention_heads >= 32  # vLLM-CPU's attention


def test_greedy_tokens_equal_transformers(trained, engine):
    prompts = {text: _chat_prompt(engine, text) for text in PROMPTS}
    run = run_engine(engine, prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for text, prompt in prompts.items():
        reference = hf_greedy(trained, prompt, 24)
        if EOS_TOKEN_ID in reference:  # the engine stops there
            reference = reference[: reference.index(EOS_TOKEN_ID) + 1]
        assert run.tokens[text] == reference, text


def test_hello_gets_an_english_reply_that_stops(engine):
    """Every word of the greedy reply is a word of the corpus, and it ends at <|end_of_turn|>
    early: random weights (or a broken engine) give word pieces and run to max_tokens."""
    run = run_engine(engine, {"hello": _chat_prompt(engine, "Hello!")},
                     SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    reply, tokens = run.text["hello"], run.tokens["hello"]
    assert run.requests["hello"].finish_reason is FinishReason.STOP, reply
    assert len(tokens) <= MAX_TOKENS // 2 and tokens[-1] == EOS_TOKEN_ID
    words = words_of(reply)
    assert words and set(words) <= vocabulary(load_conversations()), reply


def test_a_forced_tool_call_parses_and_ends_the_turn(engine):
    """The shipped chat template renders tools and the BPE vocabulary compiles under llguidance:
    a forced call is a valid hermes call that ends the turn. (The city is an enum: the model never
    saw JSON, and a free string it does not close within 64 tokens.)"""
    city = {"type": "string", "enum": ["Paris", "London"]}
    tool = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": city},
                                                  "required": ["city"], "additionalProperties": False}}
    text = engine.tokenizer.render_chat([{"role": "user", "content": "Weather in Paris?"}],
                                        tools=[{"type": "function", "function": tool}])
    constraint = {"type": "tool_calls", "tools": [tool], "parallel": False}
    run = run_engine(engine, {"call": engine.tokenizer.encode(text)},
                     SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, constraint=constraint))
    assert run.requests["call"].finish_reason is FinishReason.STOP, run.text["call"]
    content, calls = FORMATS["hermes"].parse(run.text["call"])
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments)["city"] in city["enum"]


@pytest.mark.parametrize("text", [
    "Hello! How's it going?", "  two  spaces\tand a tab\n", "café, naïve, 日本語, emoji ☕🙂",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}', "",
])
def test_tokenizer_round_trips_text(engine, text):
    tokenizer = engine.tokenizer
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert max(ids, default=0) < tokenizer.hf.vocab_size


def test_tokenizer_round_trips_a_rendered_chat(engine):
    tokenizer = engine.tokenizer
    text = tokenizer.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tokenizer.decode_exact(tokenizer.encode(text)) == text
