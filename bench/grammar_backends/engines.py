"""llguidance and xgrammar behind one small interface, for bench.grammar_backends and its test.

    engine.tokenizer_info(case)   -> the engine's view of the vocabulary (one-off)
    engine.compile(info, schema)  -> a compiled JSON-schema grammar (GrammarError if refused)
    engine.matcher(compiled)      -> a fresh Matcher: fill(bitmask), consume(token), stopped()

Both fill the same mask layout: int32 words, bit i of word w allows token 32*w + i.
Both compile with separators ", " and ": " and no free whitespace, and keep JSON Schema's own
defaults (additional properties allowed unless the schema says otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerFast

ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "


class GrammarError(Exception):
    """The engine refused a grammar, or a matcher left its grammar."""


@dataclass(frozen=True)
class TokenizerCase:
    name: str
    tokenizer: PreTrainedTokenizerFast
    vocab_size: int
    byte_level: bool  # False: ids decode one by one to their exact text (the built-in tokenizer)
    special_ids: frozenset[int]

    @staticmethod
    def of(name: str, tokenizer: PreTrainedTokenizerFast, byte_level: bool) -> TokenizerCase:
        return TokenizerCase(name, tokenizer, len(tokenizer), byte_level, frozenset(tokenizer.all_special_ids))

    def vocabulary_bytes(self) -> list[bytes]:
        """Each id's text; b"" for special ids (neither engine may place them inside the JSON)."""
        assert not self.byte_level, "byte-level ids do not decode one by one"
        return [b"" if i in self.special_ids else self.tokenizer.decode([i]).encode() for i in range(self.vocab_size)]


def new_bitmask(vocab_size: int) -> torch.Tensor:
    return torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Row 0 of a bitmask as a torch.bool of vocabulary size."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask[0].unsqueeze(-1) >> shifts) & 1).view(-1)[:vocab_size].bool()


def allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.nonzero(allowed_mask(bitmask, vocab_size)).view(-1)


class Matcher(Protocol):
    def fill(self, bitmask: torch.Tensor) -> None: ...
    def consume(self, token: int) -> bool: ...
    def stopped(self) -> bool: ...


class Engine(Protocol):
    name: str

    def tokenizer_info(self, case: TokenizerCase) -> object: ...
    def compile(self, info: object, schema: dict) -> object: ...
    def matcher(self, compiled: object) -> Matcher: ...


# --- llguidance --------------------------------------------------------------------------------


class _CharVocab:
    """What llguidance.TokenizerWrapper reads from a tokenizer whose ids decode one by one (its
    `hf.from_tokenizer` refuses the built-in tokenizer's Fuse decoder)."""

    def __init__(self, case: TokenizerCase):
        self.eos_token_id = case.tokenizer.eos_token_id
        self.bos_token_id = case.tokenizer.bos_token_id
        self.special_token_ids = sorted(case.special_ids)
        # llguidance marks a special token by a leading 0xff byte (never valid UTF-8).
        self.tokens = [b"\xff" + case.tokenizer.convert_ids_to_tokens(i).encode() if i in case.special_ids else b
                       for i, b in enumerate(case.vocabulary_bytes())]  # fmt: skip
        self._tokenizer = case.tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class LLGuidanceMatcher:
    def __init__(self, matcher):
        self._m = matcher

    def fill(self, bitmask: torch.Tensor) -> None:
        """Row 0 of a contiguous int32 mask, written in place (what `llguidance.torch`'s helper does
        after its checks; that module compiles a torch kernel when imported, seconds)."""
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)

    def consume(self, token: int) -> bool:
        return self._m.consume_token(token)

    def stopped(self) -> bool:
        return self._m.is_stopped()

    def logit_bias(self) -> bytes:
        """The mask as one byte per id (0 or 200)."""
        return self._m.compute_logit_bias()


class LLGuidance:
    name = "llguidance"

    def tokenizer_info(self, case: TokenizerCase) -> object:
        import llguidance
        import llguidance.hf

        if case.byte_level:
            return llguidance.hf.from_tokenizer(case.tokenizer, n_vocab=case.vocab_size)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_CharVocab(case)), n_vocab=case.vocab_size)

    def compile(self, info: object, schema: dict) -> object:
        """llguidance compiles when its matcher is made: the compiled grammar is a pristine matcher
        that `matcher` copies."""
        from llguidance import LLMatcher

        options = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR}
        matcher = LLMatcher(info, LLMatcher.grammar_from_json_schema(schema, defaults=options), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def matcher(self, compiled: object) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())


# --- xgrammar ----------------------------------------------------------------------------------


class XGrammarMatcher:
    def __init__(self, matcher):
        self._m = matcher

    def fill(self, bitmask: torch.Tensor) -> None:
        self._m.fill_next_token_bitmask(bitmask, 0)

    def consume(self, token: int) -> bool:
        return self._m.accept_token(token)

    def stopped(self) -> bool:
        return self._m.is_terminated()


class XGrammar:
    name = "xgrammar"

    def tokenizer_info(self, case: TokenizerCase) -> object:
        import os

        import xgrammar

        eos = case.tokenizer.eos_token_id
        if case.byte_level:
            info = xgrammar.TokenizerInfo.from_huggingface(case.tokenizer, vocab_size=case.vocab_size, stop_token_ids=[eos])
        else:  # empty entries are special ids to xgrammar
            info = xgrammar.TokenizerInfo(case.vocabulary_bytes(), xgrammar.VocabType.RAW, vocab_size=case.vocab_size,
                                          stop_token_ids=[eos])  # fmt: skip
        # A cold compile each time: the compiler's cache would hand back an earlier result.
        return xgrammar.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)

    def compile(self, info: object, schema: dict) -> object:
        try:
            return info.compile_json_schema(schema, any_whitespace=False, separators=(ITEM_SEPARATOR, KEY_SEPARATOR),
                                            strict_mode=False)  # fmt: skip
        except (RuntimeError, ValueError) as e:
            raise GrammarError(str(e)) from e

    def matcher(self, compiled: object) -> XGrammarMatcher:
        import xgrammar

        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled))


ENGINES: dict[str, type] = {"llguidance": LLGuidance, "xgrammar": XGrammar}
