"""The character-level tokenizer: vocabulary layout and exact decode/encode round trips."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from workers.checkpoint.tokenizer import write_tokenizer
from workers.checkpoint.tokens import (
    EOS_TOKEN_ID,
    NEVER_SAMPLE_TOKEN_IDS,
    ORDINARY_CHARACTERS,
    ORDINARY_TOKEN_IDS,
    SPECIAL_TOKEN_IDS,
    UNK_TOKEN_ID,
    VOCAB_SIZE,
    SpecialToken,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = write_tokenizer(tmp_path_factory.mktemp("tok"))
    return AutoTokenizer.from_pretrained(out, local_files_only=True)


def _encode(tok, text: str, split: bool) -> list[int]:
    return tok.encode(text, add_special_tokens=False, split_special_tokens=split)


def test_vocabulary_layout(tok):
    assert tok.is_fast
    assert len(tok) == VOCAB_SIZE == 104
    for special, i in SPECIAL_TOKEN_IDS.items():
        assert tok.convert_tokens_to_ids(special.value) == i
    assert tok.eos_token_id == EOS_TOKEN_ID
    assert tok.eos_token == SpecialToken.END_OF_TURN.value
    assert set(tok.all_special_ids) == set(SPECIAL_TOKEN_IDS.values())
    assert EOS_TOKEN_ID not in NEVER_SAMPLE_TOKEN_IDS
    assert set(NEVER_SAMPLE_TOKEN_IDS) | {EOS_TOKEN_ID} == set(SPECIAL_TOKEN_IDS.values())
    # one id per character, in order
    assert [_encode(tok, c, True) for c in ORDINARY_CHARACTERS] == [[i] for i in ORDINARY_TOKEN_IDS]


def test_no_spaces_no_cleanup_no_added_bos(tok):
    text = "a b  c . , ! ? 's n't\n\t end "
    ids = _encode(tok, text, False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.encode("") == []
    assert tok.encode("x") == tok.encode("x", add_special_tokens=False)


def test_non_ascii_becomes_one_unk_per_character(tok):
    assert _encode(tok, "é€\r", False) == [UNK_TOKEN_ID] * 3
    assert _encode(tok, "aé", False) == [_encode(tok, "a", False)[0], UNK_TOKEN_ID]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_ordinary_sequences_round_trip(tok, skip_special_tokens):
    rng = random.Random(0)
    ordinary = list(ORDINARY_TOKEN_IDS)
    for _ in range(300):
        ids = [rng.choice(ordinary) for _ in range(rng.randint(0, 200))]
        text = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert _encode(tok, text, True) == ids
        if not any(s.value in text for s in SpecialToken):
            assert _encode(tok, text, False) == ids


def test_sequences_with_specials_round_trip(tok):
    rng = random.Random(1)
    everything = list(range(VOCAB_SIZE))
    for _ in range(300):
        ids = [rng.choice(everything) for _ in range(rng.randint(0, 100))]
        assert _encode(tok, tok.decode(ids), False) == ids
        ordinary = [i for i in ids if i in ORDINARY_TOKEN_IDS]
        assert tok.decode(ids, skip_special_tokens=True) == tok.decode(ordinary)


def test_spelled_out_special_token_round_trips_as_text(tok):
    # The model can emit "<", "|", "e", ... one character at a time.
    spelled = _encode(tok, SpecialToken.END_OF_TURN.value, True)
    assert len(spelled) == len(SpecialToken.END_OF_TURN.value)
    text = tok.decode(spelled)
    assert text == SpecialToken.END_OF_TURN.value
    assert _encode(tok, text, True) == spelled
    assert _encode(tok, text, False) == [EOS_TOKEN_ID]  # why split_special_tokens matters
