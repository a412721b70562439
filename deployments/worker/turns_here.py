"""Which conversations a worker's engine session is using, and since when each is idle: the
replica's one count of the turns running here (the session's `use`; the tier exporter reads it).

A conversation is in use from the start of a turn's recovery to the end of its verdict: its
ledger is kept whatever its heads (the recovery ladder adopts a ledger before the turn begins).
One idle for `replica_copy_ttl_s` is forgotten whole (a DELETE that reached another replica
leaves this copy for at most that long). Event loop only.
"""

from __future__ import annotations

import time
from collections import Counter

from proto.contract import ConversationRef


class ConversationUse:
    def __init__(self) -> None:
        self._in_use: Counter[ConversationRef] = Counter()
        self._last_used: dict[ConversationRef, float] = {}

    def started(self, ref: ConversationRef) -> None:
        self._in_use[ref] += 1
        self._last_used[ref] = time.monotonic()

    def ended(self, ref: ConversationRef) -> None:
        self._in_use[ref] -= 1
        if not self._in_use[ref]:
            del self._in_use[ref]
        self._last_used[ref] = time.monotonic()

    def running(self, ref: ConversationRef) -> bool:
        """Whether a turn of the conversation runs here (from its recovery to its verdict)."""
        return ref in self._in_use

    def in_use(self) -> list[ConversationRef]:
        return list(self._in_use)

    def idle(self, ttl_s: float) -> tuple[float, list[ConversationRef]]:
        """(now, the conversations unused for more than `ttl_s` and not in use)."""
        now = time.monotonic()
        return now, [ref for ref, used in self._last_used.items() if now - used > ttl_s and ref not in self._in_use]

    def forgotten(self, now: float, idle: list[ConversationRef], busy: list[ConversationRef]) -> None:
        """`idle` (as of `now`) was forgotten except `busy` (a turn awaits its verdict: still used)."""
        for ref in idle:
            if self._last_used.get(ref) is not None and self._last_used[ref] <= now:
                del self._last_used[ref]
        for ref in busy:
            self._last_used[ref] = time.monotonic()
