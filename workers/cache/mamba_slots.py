"""Mamba state slots: one slot holds a sequence's whole recurrent state (all layers).

States are never shared: a request that continues a committed head gets its own copy, so
the head stays intact whatever happens to the turn. A holder may own several slots (a head
keeps its terminal state and its block-aligned state).

Running states are taken from the low end of the pool and snapshots from the high end, so
the sequences decoding together tend to sit in one contiguous run of slots, which the Mamba
decode then updates in place instead of gathering and scattering.
"""

from __future__ import annotations

from collections.abc import Callable

from workers.cache.holders import CacheUsage, Holder, HolderKind
from workers.cache.layout import MambaStateLayout
from workers.errors import OutOfCacheError


class MambaStateManager:
    def __init__(self, layout: MambaStateLayout):
        self.layout = layout
        self._free: set[int] = set(range(layout.num_slots))  # min/max scans: allocation is per request
        self.slots: dict[Holder, list[int]] = {}
        self.reclaim: Callable[[int], None] = lambda n: None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        if n > len(self._free):
            self.reclaim(n)
        return n <= len(self._free)

    def allocate(self, holder: Holder, high: bool = False) -> int:
        """The lowest free slot (running states), or the highest (snapshots)."""
        if not self.can_allocate(1):
            raise OutOfCacheError(f"Mamba state pool: no free slot of {self.layout.num_slots}")
        slot = max(self._free) if high else min(self._free)
        self._free.remove(slot)
        self.slots.setdefault(holder, []).append(slot)
        return slot

    def slot_of(self, holder: Holder) -> int:
        """The holder's primary (running / terminal) slot."""
        return self.slots[holder][0]

    def transfer(self, src: Holder, dst: Holder) -> None:
        assert dst not in self.slots, f"{dst} already holds slots"
        self.slots[dst] = self.slots.pop(src, [])

    def free(self, holder: Holder) -> None:
        self._free.update(self.slots.pop(holder, []))

    def usage(self) -> CacheUsage:
        in_use = sum(len(s) for h, s in self.slots.items() if h.kind is HolderKind.REQUEST)
        cached = sum(len(s) for h, s in self.slots.items() if h.kind is HolderKind.HEAD)
        return CacheUsage(free=len(self._free), cached=cached, in_use=in_use, total=self.layout.num_slots)
