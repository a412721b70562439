"""Which heads a conversation keeps: the last `retain_turns` turns', within the head budget."""

from __future__ import annotations

from workers.cache.heads import HeadManager
from workers.state_names import Holder


class HeadRetention:
    def __init__(self, heads: HeadManager, retain_turns: int):
        if retain_turns < 1:
            raise ValueError("retain_turns must be >= 1")
        self.heads = heads
        self.retain_turns = retain_turns

    def retire_older(self, key: str, turn: int, keep: Holder | None = None) -> None:
        """A new head of `turn` exists: keep only the last `retain_turns` heads, within budget.
        `keep`: a head made for a turn about to run (imported, rebuilt), never what makes room:
        evicted before the heads waiting for tools (which go last), it would have been made for
        nothing and the turn would recompute it."""
        for old in self.heads.of_conversation(key):
            if old.turn <= turn - self.retain_turns:
                self.heads.drop(old)
        self.heads.enforce_budget(protect=keep)
