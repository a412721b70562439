"""Grammars over the engine's tokenizer, compiled with llguidance.

llguidance (no runtime dependencies; masks computed in Rust with the GIL released) was chosen
over xgrammar by `bench/grammar_backends.py`. Its tokenizer view is built once per engine;
a constraint's grammar text is made and checked once and kept (an agent loop sends the same
tools every step); each request gets its own matcher.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Sequence

from workers.errors import InvalidRequestError
from workers.grammar.constraint import Constraint, ConstraintKind
from workers.tools.formats import JSON_STYLE, ToolFormat

log = logging.getLogger(__name__)
GRAMMAR_CACHE = 256  # distinct constraints whose checked grammar text is kept


def _json_grammar(schema: dict, whitespace_pattern: str = "") -> str:
    import llguidance

    style = dict(JSON_STYLE, whitespace_pattern=whitespace_pattern) if whitespace_pattern else dict(JSON_STYLE)
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=style)


# What a constraint of each kind is called in the API, for its errors.
_WHAT = {ConstraintKind.JSON_OBJECT: "the JSON object format", ConstraintKind.JSON_SCHEMA: "the schema",
         ConstraintKind.TOOL_CALLS: "the tools' parameters", ConstraintKind.REGEX: "the regex",
         ConstraintKind.CHOICE: "the choices", ConstraintKind.GRAMMAR: "the grammar"}


class GrammarCompiler:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int], tool_format: ToolFormat):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.tool_format = tool_format
        self._lock = threading.Lock()  # the tokenizer view is built once, whichever thread asks first
        self._texts = functools.lru_cache(GRAMMAR_CACHE)(self._grammar_text)

    @functools.cached_property
    def ll_tokenizer(self):
        import llguidance
        import llguidance.hf

        if self._hf is None:
            raise InvalidRequestError("this model has no tokenizer: constrained decoding needs one")
        try:
            return llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        except ValueError:  # a decoder llguidance does not read (the built-in tokenizer's Fuse)
            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(self._hf, self.vocab_size)),
                                          n_vocab=self.vocab_size, eos_token=self.eos_token_ids)

    def _grammar_text(self, constraint: Constraint) -> str:
        import llguidance

        kind = constraint.kind
        try:
            if kind is ConstraintKind.JSON_OBJECT:
                text = _json_grammar({"type": "object"}, constraint.whitespace_pattern)
            elif kind is ConstraintKind.JSON_SCHEMA:
                text = _json_grammar(constraint.value(), constraint.whitespace_pattern)
            elif kind is ConstraintKind.TOOL_CALLS:
                build = self.tool_format.auto_grammar if constraint.auto else self.tool_format.grammar
                text = llguidance.LLMatcher.grammar_from_lark(build(constraint.value(), constraint.parallel))
            else:  # regex, choice (an alternation of literals), grammar (Lark, or GBNF turned into Lark)
                text = llguidance.grammar_from(kind.value, constraint.value())
        except ValueError as error:  # a GBNF grammar that cannot be turned into Lark
            raise InvalidRequestError(f"{_WHAT[kind]} cannot be compiled into a grammar: {error}") from None
        with self._lock:
            tokenizer = self.ll_tokenizer
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if failed:
            raise InvalidRequestError(f"{_WHAT[kind]} cannot be compiled into a grammar: {messages[0]}")
        for warning in messages:
            log.info("grammar warning: %s", warning)
        return text

    def prepare(self, constraint: Constraint) -> None:
        """Make and check the constraint's grammar text now (any thread; raises
        InvalidRequestError for a bad schema): the engine thread then only builds the matcher."""
        self._texts(constraint)

    def matcher(self, constraint: Constraint):
        """A fresh matcher at the reply's start (raises InvalidRequestError for a bad schema)."""
        import llguidance

        text = self._texts(constraint)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text)
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be used: {matcher.get_error()}")
        return matcher


class _TokenBytes:
    """llguidance's view of a tokenizer whose decoder it cannot read: every id's own text."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self._hf = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.special_token_ids = sorted(set(hf_tokenizer.all_special_ids))
        self.tokens = [hf_tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode()
                       if i < len(hf_tokenizer) else b"" for i in range(vocab_size)]

    def __call__(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False)
