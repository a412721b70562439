"""The engine-side conversation ledger: committed token ids and turns, keyed by (salt, id).

Token ids are authoritative: the next turn's prompt extends them, it is never the
re-tokenized text of the history.

    token_ids:  [ turn 1: prompt suffix + reply | turn 2: suffix + reply | ... ]
                 ^ turns[0].start               ^ turns[1].start         ^ len = committed length
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The same key and digest the cache service uses, so a head is named alike everywhere.
# A salted key: the same id under another salt is another conversation, never a hit.
from cache_service.hashing import tokens_sha256 as tokens_digest  # noqa: F401  (re-exported)
from cache_service.keys import conversation_hash as conversation_key  # noqa: F401


@dataclass
class Turn:
    number: int  # 1-based
    messages: list[dict[str, Any]]  # the suffix messages, then the assistant reply
    start: int  # first token of the turn in the conversation's token ids
    end: int  # one past the turn's last (generated) token


@dataclass
class Conversation:
    key: str
    conversation_id: str
    token_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    in_flight: str | None = None  # request id of the turn being computed

    @property
    def turn(self) -> int:
        return len(self.turns)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [m for t in self.turns for m in t.messages]

    def tokens_until(self, turn: int) -> list[int]:
        return self.token_ids[: self.turns[turn - 1].end] if turn else []

    def truncate(self, turn: int) -> None:
        """Keep turns 1..turn (rewind)."""
        del self.token_ids[self.turns[turn - 1].end if turn else 0 :]
        del self.turns[turn:]

    def append(self, messages: list[dict[str, Any]], token_ids: list[int], start: int) -> Turn:
        assert start <= len(self.token_ids), "a turn starts inside the committed tokens"
        del self.token_ids[start:]
        self.token_ids.extend(token_ids)
        turn = Turn(self.turn + 1, messages, start, len(self.token_ids))
        self.turns.append(turn)
        return turn
