"""Synthetic chat text the conversation benchmarks send."""

from __future__ import annotations

import random


# Words of the synthetic chat text the conversation benchmarks send (plain ASCII, so the
# built-in tokenizer gives one token per character).
CHAT_WORDS = (
    "the model cache state turn reply token layer block prefix history user system please "
    "explain why how what when which small large fast slow exact aligned recurrent attention "
    "conversation request server replica memory compute again next first last value number "
    "list table order simple careful result check answer question detail example short long"
).split()


def chat_text(rng: random.Random, n_chars: int, lead: str = "") -> str:
    """About n_chars characters of words (the built-in tokenizer is one token per character)."""
    out = lead
    while len(out) < n_chars:
        out += (" " if out else "") + rng.choice(CHAT_WORDS)
    return out[:n_chars].rstrip() + "."
