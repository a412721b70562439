"""Building a turn's prompt: committed token ids + the template's text delta of the suffix.

    committed text  = decode(committed ids)          (what the model actually saw)
    full render     = template(history + suffix, add_generation_prompt=True)
    delta           = full render minus the committed text, if it is a prefix of it

`template` is the request's rendering (chat_template_kwargs; a stateless request may also
leave out the generation prompt or continue its last message, see template_options.py).

A turn that ended without its end-of-turn token (max_tokens, a stop string) simply gets the
template's closing tokens at the start of the delta. A template that is not append-consistent
(the committed text is not a prefix of the full render) would have to rewrite history the
cache service's ledger holds: the turn is refused with `HistoryRewriteError` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.errors import HistoryRewriteError
from workers.template_options import DEFAULT_TEMPLATE, TemplateOptions
from workers.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class TurnPrompt:
    token_ids: list[int]  # always the committed ids followed by the new ones


def build_turn_prompt(
    tokenizer: ChatTokenizer,
    committed_ids: list[int],
    history: list[dict[str, Any]],
    suffix: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template: TemplateOptions = DEFAULT_TEMPLATE,
) -> TurnPrompt:
    full = tokenizer.render(history + suffix, tools, template)
    if not committed_ids:
        return TurnPrompt(tokenizer.encode(full))
    committed_text = tokenizer.decode_exact(committed_ids)
    if not full.startswith(committed_text):
        raise HistoryRewriteError(
            "the chat template renders this conversation's history differently from the committed "
            "tokens; the new messages cannot be appended (send the same tools in every turn of a "
            "conversation, or start a new conversation)"
        )
    return TurnPrompt(committed_ids + tokenizer.encode(full[len(committed_text) :]))


def appended_ids(
    tokenizer: ChatTokenizer,
    committed_ids: list[int],
    history: list[dict[str, Any]],
    items: list[dict[str, Any]],
) -> list[int]:
    """The token ids of `items` appended to a conversation without a reply (POST
    /v1/conversations/{id}/items): the template's delta of the items, with no generation
    prompt, so that the next turn's own delta follows it exactly as if the items had come with
    that turn (an append-consistent template renders history + items + suffix as history +
    items, then the suffix)."""
    return build_turn_prompt(tokenizer, committed_ids, history, items,
                             template=TemplateOptions(add_generation_prompt=False)).token_ids[len(committed_ids):]
