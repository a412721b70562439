"""What the head manager keeps: committed heads and checkpoints, prepared turns awaiting their
verdict, and checkpoints being made (marks). Plain records; `HeadManager` owns their life."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.request import CheckpointMark, HeadAttachment, Request, ReuseSource
from workers.state_names import Holder, PrefixKey


@dataclass
class CommittedHead:
    holder: Holder
    conversation_key: str
    turn: int
    version: int  # the ledger version this head's state belongs to
    state_len: int
    aligned_len: int
    canonical_window: int = 0  # see HeadAttachment
    pinned_by: dict[str, Request] = field(default_factory=dict)  # request id -> the turn continuing it
    last_used: float = field(default_factory=time.monotonic)
    prefix: PrefixKey | None = None  # the token prefix it covers, if named in the prefix index
    source: ReuseSource = ReuseSource.HEAD  # what a request attaching it reuses (metrics)
    hits: int = 0  # requests that attached it by prefix lookup
    superseded: bool = False  # a checkpoint a longer one of the same request chain replaced
    chain_end: bool = False  # a checkpoint of where a request ended (a chain's link, not a mark)
    awaiting_tool: bool = False  # its reply ended in tool calls: the next request brings their results
    in_tier: bool = False  # the state tier holds a copy (exported or imported): evicted before heads only here

    @property
    def pins(self) -> int:
        return len(self.pinned_by)

    def attachment(self) -> HeadAttachment:
        return HeadAttachment(self.holder, self.state_len, self.aligned_len, self.canonical_window)


@dataclass
class PreparedState:
    holder: Holder
    request_id: str
    state_len: int
    aligned_len: int
    base: CommittedHead | None  # stays pinned until the turn is resolved
    deadline: float
    on_expire: Callable[[PreparedState], None] | None = None
    canonical_window: int = 0  # see HeadAttachment
    prefix: PrefixKey | None = None  # the head it becomes is named by it
    awaiting_tool: bool = False  # see CommittedHead


@dataclass
class PendingMark:
    """A checkpoint being made: its slot receives the Mamba state when the prefill passes the
    mark; then it shares the request's blocks up to there and joins the index."""

    holder: Holder
    request_id: str
    mark: CheckpointMark
    slot: int
    scheduled: bool = False  # a chunk cut its prefill there (else the slot never got the state)
