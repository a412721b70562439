"""Logprobs of a prompt's own tokens (vLLM's `prompt_logprobs`; what `echo` with `logprobs` on
completions and lm-eval's log-likelihood tasks read): the prefill runs the LM head on every row
of that request, not only on its sampled row, and keeps a log_softmax per row as small arrays.

    prompt      t0    t1    t2   ...  t(P-2)  t(P-1)       P prompt tokens
    row p       0     1     2    ...  P-2     P-1          row p predicts token p+1
    entry       e0    e1    e2   ...  e(P-2)  e(P-1)       e(p+1) = log_softmax(logits[p])[t(p+1)]
                e0: the first token, no logprob (nothing precedes it; vLLM's None)
                                              row P-1 predicts the reply's first token: sampled, not kept

Entries are written by position: a chunked prefill fills them chunk by chunk, and a preempted
request that recomputes its prompt writes the same entries again. A request wanting them never
attaches a cached prefix (engine.add_request): every row of its prompt must run here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model.hybrid_lm import HybridLM

ROWS_PER_PASS = 512  # logits of at most this many rows at once ([512, vocab] fp32), whatever the chunk


@dataclass(frozen=True)
class PromptTokenLogprob:
    token_id: int
    logprob: float | None  # None: the prompt's first token
    rank: int | None  # 1: the likeliest token
    top: tuple[tuple[int, float], ...]  # the top k (token id, logprob), likeliest first


class PromptLogprobs:
    """One request's prompt logprobs as they are computed (host tensors, one row per entry e1..)."""

    def __init__(self, prompt_ids: list[int], k: int):
        rows = len(prompt_ids) - 1
        self.k = k
        self._first = prompt_ids[0]
        self._targets = torch.tensor(prompt_ids[1:], dtype=torch.long)
        self._logprob = torch.zeros(rows, dtype=torch.float32)
        self._rank = torch.zeros(rows, dtype=torch.int64)
        self._top_ids = torch.zeros(rows, k, dtype=torch.int32)
        self._top_values = torch.zeros(rows, k, dtype=torch.float32)
        self._computed = 0  # rows [0, _computed) are written
        self._sent = False

    @property
    def num_rows(self) -> int:
        return len(self._targets)

    def record(self, start: int, logits: torch.Tensor) -> None:
        """Rows [start, start + len(logits)) of the prompt: their logits [rows, vocab]."""
        end = start + len(logits)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, self._targets[start:end].to(logprobs.device)[:, None])
        self._logprob[start:end] = chosen[:, 0].cpu()
        self._rank[start:end] = ((logprobs > chosen).sum(dim=1) + 1).cpu()
        if self.k:
            values, ids = torch.topk(logprobs, self.k, dim=-1)
            self._top_values[start:end] = values.cpu()
            self._top_ids[start:end] = ids.to(torch.int32).cpu()
        self._computed = max(self._computed, end)

    def take(self) -> tuple[PromptTokenLogprob, ...] | None:
        """The entries, one per prompt token, once every row is written, the first time only (the
        output that carries them); else None."""
        if self._sent or self._computed < self.num_rows:
            return None
        self._sent = True
        ids, values = self._top_ids.tolist(), self._top_values.tolist()
        return (PromptTokenLogprob(self._first, None, None, ()),) + tuple(
            PromptTokenLogprob(t, lp, r, tuple(zip(i, v)))
            for t, lp, r, i, v in zip(self._targets.tolist(), self._logprob.tolist(), self._rank.tolist(), ids, values))


def record_prompt_logprobs(model: HybridLM, hidden: torch.Tensor, chunks) -> None:
    """For each chunk (ScheduledChunk, in the batch's row order) of a request wanting prompt
    logprobs: the LM head on its rows that predict a prompt token, a few hundred rows at a time."""
    row = 0
    for chunk in chunks:
        wanted = chunk.request.prompt_logprobs
        if wanted is not None:
            first, end = chunk.start, min(chunk.start + chunk.num_tokens, wanted.num_rows)
            for p in range(first, end, ROWS_PER_PASS):
                q = min(p + ROWS_PER_PASS, end)
                wanted.record(p, model.compute_logits(hidden[row + p - first : row + q - first]))
        row += chunk.num_tokens
