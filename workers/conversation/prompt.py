"""Building a turn's prompt: committed token ids + the template's text delta of the suffix.

    committed text  = decode(committed ids)          (what the model actually saw)
    full render     = template(history + suffix, add_generation_prompt=True)
    delta           = full render minus the committed text, if it is a prefix of it

A turn that ended without its end-of-turn token (max_tokens, a stop string) simply gets the
template's closing tokens at the start of the delta. If the template is not append-consistent
(the committed text is not a prefix of the full render) the turn falls back to a full render
and recomputes: never a wrong reuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class TurnPrompt:
    token_ids: list[int]
    reuses_committed: bool  # False: the committed ids could not be extended (template fallback)


def build_turn_prompt(
    tokenizer: ChatTokenizer,
    committed_ids: list[int],
    history: list[dict[str, Any]],
    suffix: list[dict[str, Any]],
) -> TurnPrompt:
    full = tokenizer.render_chat(history + suffix, add_generation_prompt=True)
    if not committed_ids:
        return TurnPrompt(tokenizer.encode(full), reuses_committed=False)
    committed_text = tokenizer.decode_exact(committed_ids)
    if full.startswith(committed_text):
        return TurnPrompt(committed_ids + tokenizer.encode(full[len(committed_text) :]), reuses_committed=True)
    return TurnPrompt(tokenizer.encode(full), reuses_committed=False)
