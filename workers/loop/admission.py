"""Admission checks and the fields a request is admitted with: a refused request never reaches
the scheduler (typed errors, see workers/errors.py)."""

from __future__ import annotations

import dataclasses
import numbers

import torch

from workers.cache.heads import HeadManager
from workers.cache.layout import KVCacheLayout
from workers.cache.prefix_index import prefix_keys
from workers.deterministic.seed import derived_seed
from workers.errors import InvalidRequestError, PromptTooLongError, RequestIdInUseError
from workers.grammar.guide import TokenGuide
from workers.request import CheckpointMark, HeadAttachment
from workers.sampling import SamplingParams
from workers.scheduler import Scheduler


def check_request_id(request_id: str, scheduler: Scheduler, heads: HeadManager) -> None:
    if request_id in scheduler.requests:
        raise RequestIdInUseError(f"request id {request_id!r} is already running")
    if heads.prepared_of(request_id) is not None:  # its id names it until resolved
        raise RequestIdInUseError(f"request id {request_id!r} names a prepared turn awaiting commit or abandon")


def check_prompt(ids: list[int], vocab: int, max_model_len: int, kv_layout: KVCacheLayout) -> None:
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise InvalidRequestError("token ids must be integers")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token ids out of range [0, {vocab}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"prompt has {len(ids)} tokens; this model's limit is {max_model_len} (prompt + output)"
        )
    blocks = -(-(len(ids) + 1) // kv_layout.block_size)
    if blocks > kv_layout.usable_blocks:
        raise PromptTooLongError(f"prompt of {len(ids)} tokens cannot fit the KV cache ({blocks} blocks)")


def check_prompt_logprobs(params: SamplingParams, head: HeadAttachment | None) -> None:
    """Prompt logprobs come from the fast step's prefill rows: a deterministic request prefills
    in verify tiles, and a head's state covers its tokens without running them."""
    if params.prompt_logprobs is None:
        return
    if params.deterministic:
        raise InvalidRequestError("prompt_logprobs is not available in deterministic mode")
    if head is not None:
        raise InvalidRequestError("prompt_logprobs is not available on a conversation turn that continues a head "
                                  "(its earlier tokens are not run again)")


def seeded(params: SamplingParams, prompt: list[int]) -> SamplingParams:
    """The params with the request's own seed: derived from the prompt when deterministic (the
    same on every replica), else a fresh random one per request (not per params object)."""
    if params.seed is None and params.deterministic:
        return dataclasses.replace(params, seed=derived_seed(prompt))
    if params.seed is None:
        return dataclasses.replace(params)
    return params


def keyed_marks(scope: str, prompt: list[int], marks: tuple[CheckpointMark, ...]) -> tuple[CheckpointMark, ...]:
    """The marks inside the prompt, by position, each with the name of the prefix it ends."""
    positions = sorted({m.position for m in marks if 0 < m.position < len(prompt)})
    keys = {k.length: k for k in prefix_keys(scope, list(prompt), positions)}
    return tuple(dataclasses.replace(m, key=keys[m.position]) for m in sorted(marks, key=lambda m: m.position)
                 if m.position in keys)


def check_constraint_starts(guide: TokenGuide, banned: torch.Tensor) -> None:
    """InvalidRequestError if the constraint's grammar allows no first token the model may
    sample (`banned`: its never-sampled ids) and an empty reply is not whole either."""
    mask = guide.allowed(())
    if mask is not None and not mask.index_fill(0, banned, False).any() and not guide.accepts(()):
        raise InvalidRequestError("the constraint allows no first token this model can produce")
