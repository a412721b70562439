"""How a holder's cache resources are counted and named (who holds them, `Holder`, is named in
workers/state_names.py, below the requests and this package).

Requests' and prepared turns' resources are "in use"; resources held only by heads and
checkpoints are "cached" (evictable); the rest are "free". Both managers report the same triple and assert
it adds up. Prepared turns and heads are named by serials the head manager issues, never
by formatted strings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum


class SlotRole(Enum):
    TERMINAL = "terminal"  # the running state of a request; the state at state_len of a head
    ALIGNED = "aligned"  # the snapshot at the last aligned position (deterministic mode restarts)


@dataclass
class HolderSlots:
    """The Mamba slots of one holder, by role. Iterates terminal first, then aligned."""

    terminal: int
    aligned: int | None = None

    def __iter__(self) -> Iterator[int]:
        yield self.terminal
        if self.aligned is not None:
            yield self.aligned

    def __len__(self) -> int:
        return 1 if self.aligned is None else 2

    @property
    def roles(self) -> dict[SlotRole, int]:
        roles = {SlotRole.TERMINAL: self.terminal}
        if self.aligned is not None:
            roles[SlotRole.ALIGNED] = self.aligned
        return roles


@dataclass(frozen=True)
class CacheUsage:
    free: int
    cached: int
    in_use: int
    total: int

    def check(self, what: str) -> None:
        assert self.free + self.cached + self.in_use == self.total, f"{what} integrity: {self}"
