"""A turn's two-phase rules, one implementation for both backends' conversation bookkeeping
(our engine's TurnLifecycle, the vLLM backend's HostedConversations). Plain Python: where the
prepared state lives (our head manager's holders, an engine host's heads) is the caller's.

    prepare   turns.add(record, entry)                  the turn awaits the service's verdict
    commit    turns.entry(record, "commit"), move the state, then turns.resolve(record, COMMITTED)
              and commit_to_ledger(conv, record)        (the ledger changes only once the state moved)
    abandon   turns.entry(record, "abandon"), free the state, turns.resolve(record, ABANDONED)
    expire    unresolved after prepared_turn_timeout_s: freed, turns.resolve(record, EXPIRED)
    left      a turn whose owner is gone before it took the verdict in hand is abandoned at once,
              never left to expire (its conversation would be busy meanwhile): a stream left
              as its turn finished (AsyncEngine.stream's `on_left`, the engine host's `_left`),
              a record read but never published (the worker replica's `_run`)
    end_turn  whichever way it ends: the conversation is idle again, and a first turn that never
              committed leaves nothing

A resolution is remembered (bounded), so a second one is refused with an error naming the first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from workers.conversation.ledger import ConversationLedger
from workers.conversation.records import Resolution, TurnCommit
from workers.errors import TurnResolvedError


class Resolutions:
    """Request id -> how its prepared turn was resolved, for the last `limit` turns."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._how: OrderedDict[str, Resolution] = OrderedDict()

    def remember(self, request_id: str, how: Resolution) -> None:
        self._how[request_id] = how
        while len(self._how) > self.limit:
            self._how.popitem(last=False)

    def get(self, request_id: str) -> Resolution | None:
        return self._how.get(request_id)


class Prepared(Protocol):
    record: TurnCommit


E = TypeVar("E", bound=Prepared)


class PreparedTurns(Generic[E]):
    """The turns awaiting their verdict, by request id; each entry carries its TurnCommit record."""

    def __init__(self) -> None:
        self._entries: dict[str, E] = {}
        self._resolved = Resolutions()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[E]:
        return iter(list(self._entries.values()))

    def add(self, entry: E) -> None:
        self._entries[entry.record.request_id] = entry

    def get(self, request_id: str) -> E | None:
        return self._entries.get(request_id)

    def entry(self, record: TurnCommit, how: str) -> E:
        """The prepared turn `record` describes, still unresolved (TurnResolvedError otherwise)."""
        entry = self._entries.get(record.request_id)
        if entry is None or entry.record != record:
            done = self._resolved.get(record.request_id)
            why = f"already {done.value}" if done else "not a prepared turn of this engine"
            raise TurnResolvedError(f"cannot {how} turn {record.request_id!r}: {why}")
        return entry

    def discard(self, request_id: str) -> None:
        """A turn that never became prepared after all (its commit at once failed)."""
        self._entries.pop(request_id, None)

    def resolve(self, record: TurnCommit, how: Resolution) -> E | None:
        """The turn is resolved (its state moved or freed): no longer prepared, and remembered how."""
        self._resolved.remember(record.request_id, how)
        return self._entries.pop(record.request_id, None)


def commit_to_ledger(conv: ConversationLedger, record: TurnCommit) -> int:
    """The committed turn replaces whatever followed its base turn; returns its turn number."""
    conv.truncate(record.base_turn)
    conv.append([dict(m) for m in record.messages], list(record.token_ids))
    conv.version = record.base_version + 1
    return conv.turn


def end_turn(conversations: dict[str, ConversationLedger], conv: ConversationLedger, holds_state: bool) -> None:
    """The conversation's turn is over (committed, abandoned, expired or failed)."""
    conv.in_flight = None
    if conv.turn == 0 and not holds_state:
        conversations.pop(conv.key, None)  # a first turn that never committed leaves nothing
