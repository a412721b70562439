"""A request's plain-Python state: its tokens and the one counter that drives everything.

    token_ids:  [ prompt ............ | out0 out1 out2 ]
                 <- num_computed_tokens ->|            cached in KV / Mamba state
                                          <- to run -> next step's tokens

Prefill, chunked prefill, decode, attaching a committed head and preemption are all moves
of `num_computed_tokens`. After sampling out_k the state covers everything but out_k.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from workers.state_names import Holder, PrefixKey
from workers.sampling import SampledToken, SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(Enum):
    STOP = "stop"  # end-of-turn token, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's length limit
    ABORT = "abort"
    ERROR = "error"


class KeepState(Enum):
    """What happens to a request's KV and Mamba state when it completes (STOP / LENGTH).
    Aborted and failed requests always free it."""

    FREE = "free"
    PREPARE = "prepare"  # kept as a prepared state (with an aligned snapshot) for a commit or abandon
    CHECKPOINT = "checkpoint"  # kept as a prefix checkpoint of its tokens (a stateless request)


class ReuseSource(Enum):
    """Where the state a request started from came from (metrics: tokens reused by source)."""

    NONE = ""
    HEAD = "head"  # a committed head of an explicit conversation
    PREFIX = "prefix"  # a checkpoint at a message boundary or at the end of an earlier request
    SYSTEM = "system"  # a checkpoint at the end of a system message (shared by conversations)


@dataclass(frozen=True)
class CheckpointMark:
    """Keep the state at `position` of the prompt as a prefix checkpoint (a message boundary).
    `label` is the caller's name for it (the worker: how many messages it covers), reported
    back in the final output when the checkpoint was made."""

    position: int
    label: int
    source: ReuseSource = ReuseSource.PREFIX
    key: PrefixKey | None = None  # set by the engine


class KeptState(Protocol):
    """What a completed keep=PREPARE request left behind: the head manager's `PreparedState`
    (workers/cache/heads.py, which depends on this module, not the other way round)."""

    holder: Holder
    request_id: str
    state_len: int
    aligned_len: int


@dataclass(frozen=True)
class HeadAttachment:
    """A committed conversation head this request continues from (see workers/conversation)."""

    holder: Holder
    state_len: int  # tokens covered by the head's KV and terminal Mamba state
    aligned_len: int = 0  # position of the head's aligned Mamba state
    # The tile length W its KV and aligned state were made with by deterministic tiles
    # (0: the fast path made them, so a deterministic turn cannot restart from them).
    canonical_window: int = 0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    head: HeadAttachment | None = None
    aligned_len: int = 0  # position of the snapshot in the aligned Mamba slot (keep=PREPARE only)
    keep: KeepState = KeepState.FREE
    prefill_only: bool = False  # run the prompt, sample nothing (materializing a head)
    # Called on the engine thread once the request has ended, however it ended; what it
    # returns is reported in the final output (a conversation's `TurnCommit`). If it raises,
    # the request fails alone and its state is freed.
    on_finished: Callable[[Request], Any] | None = None
    prepared: KeptState | None = None  # a PreparedState, set when keep=PREPARE and it completed
    finish_record: Any = None  # what on_finished returned
    finish_error: str | None = None
    token_ids: list[int] = field(init=False)
    output: list[SampledToken] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # reused from a committed head on the last admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Deterministic requests (workers/deterministic): token_ids past num_verified are
    # candidates decoded on the fast path; verify_due parks the request for a verify pass.
    num_verified: int = field(init=False)
    verify_due: bool = False
    # Set by the verifier: the state it committed is canonical for tiles of W; reset to 0
    # whenever a fast step moves num_computed_tokens past it.
    tile_window: int = 0
    # Prefix reuse (workers/cache/prefix_index.py): the cache scope its states are named in
    # (None: neither looked up nor kept), the boundaries to checkpoint, the label of its final
    # state (keep=CHECKPOINT), and what it reused and made.
    prefix_scope: str | None = None
    marks: tuple[CheckpointMark, ...] = ()
    final_label: int = 0
    reused_from: ReuseSource = ReuseSource.NONE
    prefix_lookup: bool = False  # attach the longest held prefix when admitted without a head
    prefixes_seen: int = -1  # the prefix index's version at its last lookup (a miss is not redone)
    held_estimate: tuple[int, int] = (-1, 0)  # (index version, tokens held) while it waits, for routing stats
    checkpoints_made: list[tuple[int, int]] = field(default_factory=list)  # (label, tokens)
    checkpoint_keys: list[PrefixKey] = field(default_factory=list)  # their names, in the same order
    # A constrained reply's TokenGuide (workers/grammar/guide.py): the tokens it may sample next.
    guide: Any = None
    awaiting_tool: bool = False  # it stopped right after a tool call (its kept state waits for the results)
    # n > 1 (workers/loop/forks.py): choice `choice` of the group named by choice 0's id
    # (`group_id`; "" on choice 0 itself); choice 0 holds the other choices in `forks` until its
    # prefill ends and they fork from its state. Only choice 0 keeps state (commit, checkpoint).
    choice: int = 0
    group_id: str = ""
    forks: list[Request] = field(default_factory=list)
    # params.prompt_logprobs set: a PromptLogprobs (workers/prompt_logprobs.py) the prefill fills;
    # on choice 0 only (the prompt is the group's: its forks start after it)
    prompt_logprobs: Any = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_verified = len(self.token_ids)

    @property
    def group(self) -> str:
        """The id its outputs are streamed under: choice 0's."""
        return self.group_id or self.request_id

    @property
    def reply_ids(self) -> list[int]:
        """The tokens after the prompt (a deterministic request's candidates included)."""
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def deterministic(self) -> bool:
        return self.params.deterministic

    @property
    def needs_aligned_slot(self) -> bool:
        """A second Mamba slot: the aligned state a published head keeps, or the state at the
        tile start a deterministic request restarts every verify pass from."""
        return self.keep is KeepState.PREPARE or self.deterministic

    def drop_unverified(self) -> None:
        """Forget the candidates (the request's state is being thrown away: preemption)."""
        del self.token_ids[self.num_verified :]
        self.verify_due = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append(self, sampled: SampledToken) -> None:
        """A token the client sees (a deterministic request's candidates are not appended here)."""
        self.token_ids.append(sampled.token_id)
        self.output.append(sampled)
        self.num_verified = len(self.token_ids)
