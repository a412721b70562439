"""The vocabulary of the built-in character-level tokenizer: which id is which token.

Id layout (fixed, so tests and the engine can rely on it):

    0..5    special tokens, in the order of SPECIAL_TOKENS below
    6, 7    "\\t", "\\n"
    8..102  printable ASCII 0x20 (" ") .. 0x7E ("~"), one id per character
    103     <|reserved_0|>: pads the vocabulary to a multiple of 8 so that every
            row of the model's embedding matrix is a token the tokenizer knows

Text outside this alphabet (any non-ASCII character, "\\r", other control characters)
is encoded as <|unk|>, one id per character. The model is never allowed to sample
<|unk|>, so everything the model can emit round-trips through decode/encode exactly.
"""

from __future__ import annotations

from enum import Enum


class SpecialToken(str, Enum):
    PAD = "<|pad|>"
    BOS = "<|bos|>"
    END_OF_TURN = "<|end_of_turn|>"  # also the EOS token
    UNK = "<|unk|>"
    START_OF_ROLE = "<|start_of_role|>"
    END_OF_ROLE = "<|end_of_role|>"
    RESERVED_0 = "<|reserved_0|>"


# Ids are part of the checkpoint contract (config.json / generation_config.json repeat them).
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2  # <|end_of_turn|>
UNK_TOKEN_ID = 3
START_OF_ROLE_TOKEN_ID = 4
END_OF_ROLE_TOKEN_ID = 5
RESERVED_0_TOKEN_ID = 103

_LEADING_SPECIALS = (
    SpecialToken.PAD,
    SpecialToken.BOS,
    SpecialToken.END_OF_TURN,
    SpecialToken.UNK,
    SpecialToken.START_OF_ROLE,
    SpecialToken.END_OF_ROLE,
)
ORDINARY_CHARACTERS: tuple[str, ...] = ("\t", "\n") + tuple(chr(c) for c in range(0x20, 0x7F))
FIRST_ORDINARY_ID = len(_LEADING_SPECIALS)
VOCAB_MULTIPLE = 8


def build_vocab() -> dict[str, int]:
    """token string -> id, for the whole vocabulary (specials included)."""
    tokens = [t.value for t in _LEADING_SPECIALS] + list(ORDINARY_CHARACTERS) + [SpecialToken.RESERVED_0.value]
    vocab = {token: i for i, token in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate token"
    assert vocab[SpecialToken.END_OF_TURN.value] == EOS_TOKEN_ID
    assert vocab[SpecialToken.RESERVED_0.value] == RESERVED_0_TOKEN_ID
    assert len(vocab) % VOCAB_MULTIPLE == 0
    return vocab


VOCAB_SIZE = len(ORDINARY_CHARACTERS) + len(SpecialToken)  # 104
SPECIAL_TOKEN_IDS: dict[SpecialToken, int] = {
    SpecialToken.PAD: PAD_TOKEN_ID,
    SpecialToken.BOS: BOS_TOKEN_ID,
    SpecialToken.END_OF_TURN: EOS_TOKEN_ID,
    SpecialToken.UNK: UNK_TOKEN_ID,
    SpecialToken.START_OF_ROLE: START_OF_ROLE_TOKEN_ID,
    SpecialToken.END_OF_ROLE: END_OF_ROLE_TOKEN_ID,
    SpecialToken.RESERVED_0: RESERVED_0_TOKEN_ID,
}
# The engine masks these logits: every special id except end-of-turn, which ends a turn.
NEVER_SAMPLE_TOKEN_IDS: tuple[int, ...] = tuple(
    sorted(i for t, i in SPECIAL_TOKEN_IDS.items() if t is not SpecialToken.END_OF_TURN)
)
ORDINARY_TOKEN_IDS: range = range(FIRST_ORDINARY_ID, FIRST_ORDINARY_ID + len(ORDINARY_CHARACTERS))
