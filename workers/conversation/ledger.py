"""The engine-side conversation ledger: a cache of the cache service's ledger, by version.

Token ids are authoritative: the next turn's prompt extends them, it is never the
re-tokenized text of the history.

    token_ids:  [ turn 1: prompt suffix + reply | turn 2: suffix + reply | ... ]
                 ^ turns[0].start               ^ turns[1].start         ^ len = committed length
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# A conversation is named and its tokens digested exactly as the cache service does.
from proto.contract import ConversationRef, tokens_digest
from workers.conversation.records import HeadInfo
from workers.errors import ConversationBusyError, ConversationNotFoundError

if TYPE_CHECKING:
    from workers.cache.heads import CommittedHead


@dataclass
class Turn:
    number: int  # 1-based
    messages: list[dict[str, Any]]  # the suffix messages, then the assistant reply
    start: int  # first token of the turn in the conversation's token ids
    end: int  # one past the turn's last (generated) token


@dataclass
class ConversationLedger:
    ref: ConversationRef
    token_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    version: int = 0  # the head version this ledger is (the service's, +1 per publish)
    in_flight: str | None = None  # request id of the turn being computed or awaiting its verdict

    @property
    def key(self) -> str:
        return self.ref.key

    @property
    def turn(self) -> int:
        return len(self.turns)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [m for t in self.turns for m in t.messages]

    def ensure_idle(self) -> None:
        """Refuse to change a conversation while a turn (or a head rebuild) is in flight or
        awaiting its verdict: that turn's commit would land on a ledger it did not start from."""
        if self.in_flight is not None:
            raise ConversationBusyError(f"conversation {self.ref.id!r} has a turn in flight")

    def tokens_until(self, turn: int) -> list[int]:
        return self.token_ids[: self.turns[turn - 1].end] if turn else []

    def truncate(self, turn: int) -> None:
        """Keep turns 1..turn (rewind)."""
        del self.token_ids[self.turns[turn - 1].end if turn else 0 :]
        del self.turns[turn:]

    def append(self, messages: list[dict[str, Any]], token_ids: list[int]) -> Turn:
        """Append a turn: history is only ever extended, never rewritten."""
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        turn = Turn(self.turn + 1, messages, start, len(self.token_ids))
        self.turns.append(turn)
        return turn

    def head_info(self, head: CommittedHead) -> HeadInfo:
        """What the caller learns about a head of this conversation."""
        committed = self.tokens_until(head.turn)
        return HeadInfo(
            self.key, head.turn, head.version, len(committed), tokens_digest(committed),
            head.state_len, head.aligned_len,
        )


def find_conversation(conversations: dict[str, ConversationLedger], ref: ConversationRef) -> ConversationLedger:
    """The engine's ledger of a conversation, by key; ConversationNotFoundError if none."""
    conv = conversations.get(ref.key)
    if conv is None:
        raise ConversationNotFoundError(f"no conversation {ref.id!r} under this cache_salt")
    return conv
