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


def scripted_conversation(rng: random.Random, index: int, turns: int, system_tokens: int,
                          user_tokens: tuple[int, int], reply_tokens: tuple[int, int]) -> tuple[str, list[str], list[int]]:
    """Conversation `index` of a workload: its system prompt, one question per turn and the length
    of each reply (drawn in that order, so a seed gives the same conversations everywhere)."""
    system = chat_text(rng, system_tokens, f"You are assistant #{index}. Answer carefully.")
    users = [chat_text(rng, rng.randint(*user_tokens), f"Question {t + 1}:") for t in range(turns)]
    replies = [rng.randint(*reply_tokens) for _ in range(turns)]
    return system, users, replies
