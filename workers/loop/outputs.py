"""What a step reports for one request: a `RequestOutput` (a delta, not the whole text)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from workers.prompt_logprobs import PromptTokenLogprob
from workers.request import FinishReason, Request, ReuseSource
from workers.sampling import SampledToken
from workers.state_names import PrefixKey


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (a delta, not the whole text)."""

    request_id: str
    new_tokens: tuple[SampledToken, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    # The error is the request's own doing, not the server's: its constraint allows no token the
    # model may produce from where the reply stands (a 400, not a 500).
    error_invalid: bool = False
    seed: int = 0  # the sampling seed used (drawn from the OS for unseeded requests)
    # What the request's on_finished returned, on its final output: a conversation turn's
    # `TurnCommit` (see workers/conversation/API.md).
    turn_commit: Any = None
    # Prefix reuse, on the final output: the prefix checkpoints the request made, as (the mark's
    # label, tokens) — the worker labels a mark by the messages it covers, k for messages[:k]
    # (len(messages) + 1: the messages and the reply), and announces them to the prefix index
    # (deployments/routing/prefix_hints.py) — and where its reused state came from.
    checkpoints: tuple[tuple[int, int], ...] = ()
    # The engine's names of those checkpoints, in the same order (empty where a backend has none):
    # when one is evicted, the engine's `withdrawn` names it, and the worker withdraws its announce.
    checkpoint_keys: tuple[PrefixKey, ...] = ()
    reused_from: ReuseSource = ReuseSource.NONE
    # n > 1: which choice this is, of how many, and the id of the group (choice 0's request id,
    # the one its caller streams)
    index: int = 0
    choices: int = 1
    group_id: str = ""
    # params.prompt_logprobs set: an entry per prompt token (the first without a logprob), on the
    # first output after its prefill (workers/prompt_logprobs.py); choice 0's only (n > 1)
    prompt_logprobs: tuple[PromptTokenLogprob, ...] | None = None

    @property
    def stream_id(self) -> str:
        return self.group_id or self.request_id

    @property
    def new_token_ids(self) -> list[int]:
        return [t.token_id for t in self.new_tokens]


def output_of(request: Request, tokens: Iterable[SampledToken], delta: str, error: str | None = None,
              invalid: bool = False) -> RequestOutput:
    """The request's output for this step (its final fields once it has finished)."""
    return RequestOutput(
        request_id=request.request_id,
        error_invalid=invalid,
        new_tokens=tuple(tokens),
        text_delta=delta,
        finished=request.is_finished,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        error=error or request.finish_error,
        seed=request.params.resolved_seed,
        turn_commit=request.finish_record if request.is_finished else None,
        checkpoints=tuple(request.checkpoints_made) if request.is_finished else (),
        checkpoint_keys=tuple(request.checkpoint_keys) if request.is_finished else (),
        reused_from=request.reused_from,
        index=request.choice,
        choices=request.params.n,
        group_id=request.group,
        prompt_logprobs=request.prompt_logprobs.take() if request.prompt_logprobs is not None else None,
    )
