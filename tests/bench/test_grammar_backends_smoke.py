"""The grammar engines as bench.grammar_backends drives them, on the built-in 104-id tokenizer:
each allows the tokens one small schema allows at hand-checked points of one fixed sequence, and
the two engines allow the same set of tokens at every step of it. xgrammar is not in the CI
install: its half is skipped there.
"""

from __future__ import annotations

import pytest

from bench.grammar_backends.engines import ENGINES, Engine, TokenizerCase, allowed_ids, new_bitmask
from workers.checkpoint.tokenizer import build_tokenizer
from workers.checkpoint.tokens import EOS_TOKEN_ID

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},  # no length bounds: there xgrammar 0.2.8 allows a raw tab (invalid JSON)
        "colour": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "colour", "n", "ok"],
    "additionalProperties": False,
}
TEXT = '{"name": "abcdef", "colour": "green", "n": 42, "ok": true}'
DIGITS = set("0123456789")
# After these prefixes of TEXT, exactly these texts may come next (None: end of sequence).
EXPECTED = {
    "": {"{"},
    "{": {'"'},
    '{"name"': {":"},
    '{"name":': {" "},  # the key separator is ": ", no other whitespace
    '{"name": "abcdef",': {" "},
    '{"name": "abcdef", "colour": "': {"r", "g"},
    '{"name": "abcdef", "colour": "g': {"r"},
    '{"name": "abcdef", "colour": "green", "n": ': DIGITS,
    '{"name": "abcdef", "colour": "green", "n": 4': DIGITS | {","},
    '{"name": "abcdef", "colour": "green", "n": 42': {","},  # 420 > maximum
    '{"name": "abcdef", "colour": "green", "n": 42, "ok": ': {"t", "f"},
    TEXT: {None},
}


@pytest.fixture(scope="module")
def case() -> TokenizerCase:
    return TokenizerCase.of("char-104", build_tokenizer(), byte_level=False)


def masks_along(engine: Engine, case: TokenizerCase, tokens: list[int]) -> list[set[int]]:
    """The allowed ids before each token of the sequence (and the matcher takes every one)."""
    matcher = engine.matcher(engine.compile(engine.tokenizer_info(case), SCHEMA))
    masks = []
    for token in tokens:
        bitmask = new_bitmask(case.vocab_size)
        matcher.fill(bitmask)
        masks.append(set(allowed_ids(bitmask, case.vocab_size).tolist()))
        assert matcher.consume(token), f"{engine.name} refused token {token} after {masks[-1]}"
    assert matcher.stopped()
    return masks


def sequence(case: TokenizerCase) -> list[int]:
    return case.tokenizer.encode(TEXT, add_special_tokens=False) + [EOS_TOKEN_ID]


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_the_engine_allows_what_the_schema_allows(name, case):
    pytest.importorskip(name)
    tokens = sequence(case)
    masks = masks_along(ENGINES[name](), case, tokens)
    for prefix, texts in EXPECTED.items():
        expected = {EOS_TOKEN_ID if t is None else case.tokenizer.convert_tokens_to_ids(t) for t in texts}
        assert masks[len(prefix)] == expected, f"after {prefix!r}"
    for step, mask in enumerate(masks):
        assert tokens[step] in mask
        assert (EOS_TOKEN_ID in mask) == (step == len(tokens) - 1), "end of sequence only after the object"
        assert not mask & (case.special_ids - {EOS_TOKEN_ID}), "a special token allowed inside the JSON"


def test_both_engines_allow_the_same_tokens_at_every_step(case):
    pytest.importorskip("llguidance")
    pytest.importorskip("xgrammar")
    tokens = sequence(case)
    llguidance, xgrammar = (masks_along(ENGINES[n](), case, tokens) for n in ("llguidance", "xgrammar"))
    assert len(llguidance) == len(xgrammar) == len(tokens)
    for step, (a, b) in enumerate(zip(llguidance, xgrammar)):
        assert a == b, f"after {case.tokenizer.decode(tokens[:step])!r}: only llguidance {a - b}, only xgrammar {b - a}"
