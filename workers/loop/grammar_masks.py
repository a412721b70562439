"""Constrained requests' masks: the tokens each one's grammar allows next (workers/grammar/guide.py
computes them on its own threads while the model runs)."""

from __future__ import annotations

import torch

from workers.grammar.guide import GrammarError
from workers.request import Request


# The value of a request in grammar_masks' second result whose grammar is complete where only
# tokens the model never samples (its end of turn, on a model that bans it) could follow: its
# reply ends there, as a grammar that ends a reply does.
COMPLETE = ""


def grammar_masks(requests: list[Request], banned: torch.Tensor) -> tuple[list[torch.Tensor | None] | None, dict]:
    """Per row, the tokens its grammar allows next (None: the batch has no constrained request),
    and the requests whose grammar failed or allows nothing that may be sampled (request id ->
    why, or COMPLETE where the grammar's reply is whole): they end alone, whatever their rows draw."""
    if all(r.guide is None for r in requests):
        return None, {}
    masks, failed = [], {}
    for request in requests:
        mask = None
        if request.guide is not None:
            try:
                mask = request.guide.allowed(request.reply_ids)
            except GrammarError as e:
                failed[request.request_id] = str(e)
            if mask is not None and not mask.index_fill(0, banned, False).any():
                complete = request.guide.accepts(request.reply_ids)
                failed[request.request_id] = COMPLETE if complete else "the grammar allows no token the model may sample"
                mask = None
        masks.append(mask)
    return masks, failed


def prefetch_mask(request: Request) -> None:
    """Start computing the mask after the request's latest token (used by the next step)."""
    if request.guide is not None:
        request.guide.prefetch(request.reply_ids)
