"""The sampling fields that change logits before the draw, as vLLM applies them (its v1 sampler):

    logits (banned ids and grammars masked)
      -> logit_bias            logits[t] += bias[t]
      -> min_tokens            EOS and stop_token_ids -> -inf while fewer than min_tokens are generated
      -> repetition_penalty    tokens of the prompt or the output: logit > 0 ? logit / p : logit * p
      -> frequency, presence   logits -= frequency * count_out[t] + presence * (count_out[t] > 0)
      -> temperature, top-k, min-p, top-p, the draw (sampling.py); greedy is the argmax of these

`count_out` counts the tokens generated before the one being drawn (OpenAI's and vLLM's
penalties see the output only; the repetition penalty sees the prompt too). Each row's result is
a function of its own logits and tokens, so a batch, a replay and a verify pass agree.

Only rows whose params ask for a processor are touched: a batch without any costs one check of
its params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class ProcessorParams(Protocol):
    """The fields of SamplingParams (sampling.py, which calls this module) the processors read."""

    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool

    @property
    def processes(self) -> bool: ...

    @property
    def penalized(self) -> bool: ...


@dataclass(frozen=True)
class TokenHistory:
    """A row's tokens as its processors see them (only rows whose params process need one)."""

    prompt: Sequence[int]
    output: Sequence[int]  # generated before the token being drawn


def apply_processors(
    logits: torch.Tensor,  # [B, V] float32, the caller's to modify in place
    params: list[ProcessorParams],
    histories: list[TokenHistory | None],
    eos_token_ids: frozenset[int],
    allowed: list[torch.Tensor | None] | None = None,  # the grammar masks already applied, per row
) -> None:
    rows = [i for i, p in enumerate(params) if p.processes]
    if not rows:
        return
    vocab = logits.shape[1]
    for row in rows:
        p, history = params[row], histories[row]
        assert history is not None, "a row whose params process needs its token history"
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
            logits[row].index_add_(0, ids, bias)
        if len(history.output) < p.min_tokens:
            _hold_back_ends(logits[row], p, eos_token_ids, vocab, allowed[row] if allowed else None)
    penalized = [i for i in rows if params[i].penalized]
    if penalized:
        logits[penalized] = _penalize(logits[penalized], [params[i] for i in penalized],
                                      [histories[i] for i in penalized])


def _hold_back_ends(row: torch.Tensor, p: ProcessorParams, eos_token_ids: frozenset[int], vocab: int,
                    grammar: torch.Tensor | None) -> None:
    """min_tokens: the ids that would end the request cannot be drawn yet. A grammar that allows
    nothing else (its reply is complete) wins, as in vLLM: its end ids are given back."""
    ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    ids = torch.tensor(sorted(t for t in ends if t < vocab), dtype=torch.long, device=row.device)
    if not ids.numel():
        return
    kept = row[ids].clone() if grammar is not None else None
    row.index_fill_(0, ids, -torch.inf)
    if kept is not None and not torch.isfinite(row).any():
        row.index_copy_(0, ids, kept)


def _counts(sequences: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] occurrences of each token per row (padding counts into a dropped column V)."""
    width = max((len(s) for s in sequences), default=0)
    index = torch.full((len(sequences), max(width, 1)), vocab, dtype=torch.long)
    for r, s in enumerate(sequences):
        if s:
            index[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    index = index.to(device)
    counts = torch.zeros(len(sequences), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def _penalize(logits: torch.Tensor, params: list[ProcessorParams], histories: list[TokenHistory]) -> torch.Tensor:
    """vLLM's apply_penalties on the rows that ask for a penalty ([R, V] in, [R, V] out)."""
    vocab, device = logits.shape[1], logits.device
    output_counts = _counts([h.output for h in histories], vocab, device)
    output_seen = output_counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = output_seen | (_counts([h.prompt for h in histories], vocab, device) > 0)
        repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
        penalties = torch.where(seen, repetition[:, None], 1.0)
        logits = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
    return logits - frequency[:, None] * output_counts - presence[:, None] * output_seen
