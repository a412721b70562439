"""What this ingress saw a replica leave behind: the prefix checkpoints of the answers it just
forwarded, as routing hints that need no round trip and cannot lose a race.

    request k  ── worker ──> TurnDone(replica R, prefixes [(name, tokens)])
                                  │ recorded here, before the client sees the answer's end
    request k+1 (the loop's next step, its history + the reply + a tool result)
        find_holders: index lookup ∪ these -> R holds `tokens` of it

The worker also announces the same names to the cache service's prefix index (prefix_hints.py),
which every ingress reads; but the announce is a task of its own on a busy worker and may land
after the loop's next lookup (the announce race). The ingress that forwarded the answer knows
already: the names are exact (the worker computed them as it announces them), and the record
is a dict update. A hint lives RECENT_TTL_S: past that the announce has landed and the index,
which also hears withdrawals (evictions), is the one to trust.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Long enough for any announce to land (one Redis round trip; seconds on an overloaded host),
# short enough that an eviction the index was told about stops misleading the router soon.
RECENT_TTL_S = 30.0
# Names remembered at most (the oldest go first): a burst of answers must not grow the ingress.
RECENT_KEPT = 4096


class RecentPrefixes:
    """name -> {replica: (tokens, when recorded)}, the newest last."""

    def __init__(self, ttl_s: float = RECENT_TTL_S, kept: int = RECENT_KEPT):
        self.ttl_s, self.kept = ttl_s, kept
        self._held: OrderedDict[str, dict[str, tuple[int, float]]] = OrderedDict()

    def record(self, replica: str, prefixes: Iterable[tuple[str, int]]) -> None:
        now = time.monotonic()
        for name, tokens in prefixes:
            self._held.setdefault(name, {})[replica] = (tokens, now)
            self._held.move_to_end(name)
        while len(self._held) > self.kept:
            self._held.popitem(last=False)

    def holders(self, names: Sequence[str]) -> dict[str, int]:
        """replica -> the most tokens it was seen to leave of any of `names` within the TTL."""
        fresh_after = time.monotonic() - self.ttl_s
        best: dict[str, int] = {}
        for name in names:
            for replica, (tokens, at) in self._held.get(name, {}).items():
                if at >= fresh_after and tokens > best.get(replica, 0):
                    best[replica] = tokens
        return best


def merged(indexed: Iterable[tuple[str, int]], recent: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """Each replica once, with the most tokens either source names."""
    if not recent:
        return tuple(indexed)
    best = dict(recent)
    for replica, tokens in indexed:
        best[replica] = max(tokens, best.get(replica, 0))
    return tuple(sorted(best.items()))


# The ingress's own (one per process: its TurnRuns record, its lookups read).
RECENT = RecentPrefixes()
