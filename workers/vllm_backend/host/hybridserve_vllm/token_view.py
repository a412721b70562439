"""llguidance's view of a tokenizer (the text of every token id) for vLLM's guidance backend in
the engine host: the same view our grammar compiler builds (workers/grammar/compiler.py,
`_TokenBytes`), so a constraint masks the same tokens on both backends. It is that view written
again on purpose: this package runs in the vLLM environment, where our package is not installed,
and our compiler must not import the vLLM backend's room (the grammar serves both backends).

llguidance reads a fast Hugging Face tokenizer's decoder itself; one it cannot read (the
built-in model's character-level tokenizer, whose decoder is a Fuse) gets a table of every
id's own text instead. vLLM's guidance backend knows only the first way: `use_in_vllm` gives it
the second too. Only llguidance and (for `use_in_vllm`) vLLM are imported: this runs in both
environments.
"""

from __future__ import annotations

from collections.abc import Sequence


def ll_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int] | int | None = None):
    import llguidance
    import llguidance.hf

    eos = list(eos_token_ids) if isinstance(eos_token_ids, Sequence) else eos_token_ids
    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError:  # a decoder llguidance does not read
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(hf_tokenizer, vocab_size)),
                                      n_vocab=vocab_size, eos_token=eos)


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


def use_in_vllm() -> None:
    """vLLM's guidance backend builds its tokenizer view with `ll_tokenizer` (its own call first:
    what it does for every tokenizer llguidance reads is unchanged). Call before the first
    structured request: the backend is made then."""
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend

    vllms = GuidanceBackend._build_ll_tokenizer

    def build(tokenizer, vocab_size: int):
        try:
            return vllms(tokenizer, vocab_size)
        except ValueError:
            return ll_tokenizer(tokenizer, max(vocab_size, len(tokenizer)), tokenizer.eos_token_id)

    GuidanceBackend._build_ll_tokenizer = staticmethod(build)
