"""Who holds a cache resource: a running request, a prepared turn, a committed head or a
prefix checkpoint.

Requests' and prepared turns' resources are "in use"; resources held only by heads and
checkpoints are "cached" (evictable); the rest are "free". Both managers report the same triple and assert
it adds up. Prepared turns and heads are named by serials the head manager issues, never
by formatted strings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum


class HolderKind(Enum):
    REQUEST = "request"
    PREPARED = "prepared"  # a finished turn's state awaiting commit or abandon
    HEAD = "head"
    CHECKPOINT = "checkpoint"  # the state at a prefix of some prompt, owned by no conversation
    MARK = "mark"  # a checkpoint being made: a slot a running request's prefill will snapshot into

    @property
    def cached(self) -> bool:
        """Evictable: nothing running needs it."""
        return self in (HolderKind.HEAD, HolderKind.CHECKPOINT)


@dataclass(frozen=True)
class Holder:
    kind: HolderKind
    id: str | int  # the request id (REQUEST), or a serial of the head manager (PREPARED, HEAD)

    @staticmethod
    def request(request_id: str) -> Holder:
        return Holder(HolderKind.REQUEST, request_id)

    @staticmethod
    def prepared(serial: int) -> Holder:
        return Holder(HolderKind.PREPARED, serial)

    @staticmethod
    def head(serial: int) -> Holder:
        return Holder(HolderKind.HEAD, serial)


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
