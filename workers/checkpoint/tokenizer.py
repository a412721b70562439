"""Builds and writes the character-level tokenizer of the built-in checkpoints.

A BPE model with single-character vocabulary and no merges, no normalizer and no
pre-tokenizer: every character becomes exactly one token, so decoding then encoding
any sequence of ordinary ids gives the same ids back. The `Fuse` decoder concatenates
tokens (the `tokenizers` default would join them with spaces).

Special tokens are whole-string matches when encoding. Text that spells a special token
with ordinary characters (e.g. the model emitting "<", "|", "p", "a", "d", "|", ">")
round-trips only when special-token matching is off: encode with
`split_special_tokens=True`, or `apply_chat_template(..., sanitize_control_tokens=True)`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from workers.checkpoint.chat_template import CHAT_TEMPLATE
from workers.checkpoint.tokens import SpecialToken, build_vocab

# Engine prompts can be long; the model's own max_position_embeddings is the real limit.
_MODEL_MAX_LENGTH = 1 << 20


def build_backend_tokenizer() -> Tokenizer:
    """The raw `tokenizers.Tokenizer` (what ends up in tokenizer.json)."""
    tokenizer = Tokenizer(models.BPE(vocab=build_vocab(), merges=[], unk_token=SpecialToken.UNK.value))
    tokenizer.decoder = decoders.Fuse()
    # normalized=False and no stripping: a special token is matched verbatim and eats no
    # neighbouring whitespace, which keeps the template's text and token ids aligned.
    tokenizer.add_special_tokens(
        [AddedToken(t.value, special=True, normalized=False, lstrip=False, rstrip=False) for t in SpecialToken]
    )
    return tokenizer


def build_tokenizer(backend: Tokenizer | None = None) -> PreTrainedTokenizerFast:
    """The transformers wrapper, with the special-token roles and the chat template set;
    backend: another `tokenizers.Tokenizer` with the same special tokens (the trained BPE one of
    `bpe_tokenizer.py`), default the character-level one."""
    extra = [
        t.value
        for t in SpecialToken
        if t not in (SpecialToken.PAD, SpecialToken.BOS, SpecialToken.END_OF_TURN, SpecialToken.UNK)
    ]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend or build_backend_tokenizer(),
        pad_token=SpecialToken.PAD.value,
        bos_token=SpecialToken.BOS.value,
        eos_token=SpecialToken.END_OF_TURN.value,
        unk_token=SpecialToken.UNK.value,
        extra_special_tokens=extra,
        add_bos_token=False,  # the chat template decides what starts a prompt
        add_eos_token=False,
        clean_up_tokenization_spaces=False,  # would turn " ." into "." and break round trips
        model_max_length=_MODEL_MAX_LENGTH,
        chat_template=CHAT_TEMPLATE,
    )


def write_tokenizer(out_dir: str | Path) -> Path:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(out)
    return out
