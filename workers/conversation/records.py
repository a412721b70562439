"""Plain records that cross the engine's boundary for a conversation turn (see API.md)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from proto.contract import ConversationRef
from workers.request import FinishReason


class CommitMode(Enum):
    AT_ONCE = "at_once"  # in-process: a completed turn becomes the head immediately
    PREPARE = "prepare"  # two-phase: kept prepared until commit() or abandon()


class TurnOutcome(Enum):
    """How a turn ended for its conversation (counted in `ConversationCache.stats()`)."""

    PUBLISHED = "published"  # committed: the head and the ledger moved on
    DISCARDED = "discarded"  # aborted, failed, abandoned or expired: nothing changed


class Resolution(Enum):
    """How a prepared turn was resolved (a second resolution is refused, naming the first)."""

    COMMITTED = "committed"
    ABANDONED = "abandoned"
    EXPIRED = "expired"


@dataclass(frozen=True)
class TurnCommit:
    """A completed turn awaiting its verdict; maps onto the cache service's PublishTurn."""

    request_id: str
    conversation: ConversationRef
    base_version: int  # the head version the turn continues (PublishTurn's expected_version)
    base_turn: int  # 0: none
    start: int  # committed length of base_turn: the new ids start there
    token_ids: tuple[int, ...]  # the ledger delta: suffix prompt ids + generated ids
    messages: tuple[dict[str, Any], ...]  # suffix messages, then the assistant reply
    committed_tokens: int  # start + len(token_ids)
    tokens_digest: str  # contract.tokens_digest of all committed ids after this turn
    state_len: int  # tokens the prepared state covers (committed_tokens - 1)
    finish_reason: FinishReason


@dataclass(frozen=True)
class HeadInfo:
    conversation_key: str
    turn: int
    version: int
    committed_tokens: int
    tokens_digest: str
    state_len: int
    aligned_len: int


@dataclass(frozen=True)
class LedgerTurn:
    """One turn of a ledger read from the cache service: its messages and token id delta."""

    messages: tuple[dict[str, Any], ...]
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class LedgerState:
    """Where the engine's ledger of a conversation stands (`ConversationCache.ledger_state`)."""

    version: int
    turn: int
    token_ids: tuple[int, ...]
    busy: bool  # a turn or a head rebuild is in flight or awaiting its verdict
