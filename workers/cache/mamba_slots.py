"""Mamba state slots: one slot holds a sequence's whole recurrent state (all layers).

States are never shared: a request that continues a committed head gets its own copy, so
the head stays intact whatever happens to the turn. A holder owns a terminal slot and, if it
will publish, an aligned one (typed roles, see `HolderSlots`).

Running states are taken from the low end of the pool and snapshots from the high end, so
the sequences decoding together tend to sit in one contiguous run of slots, which the Mamba
decode then updates in place instead of gathering and scattering.

Allocation never evicts: the coordinator makes room first (all-or-nothing).
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.cache.holders import CacheUsage, HolderSlots
from workers.state_names import Holder
from workers.cache.layout import MambaStateLayout
from workers.cache.manager import CacheManager
from workers.errors import OutOfCacheError


class MambaStateManager(CacheManager):
    def __init__(self, layout: MambaStateLayout):
        self.layout = layout
        self._free: set[int] = set(range(layout.num_slots))  # min/max scans: allocation is per request
        self.slots: dict[Holder, HolderSlots] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holders(self) -> Iterable[Holder]:
        return self.slots.keys()

    def allocate(self, holder: Holder, aligned: bool) -> HolderSlots:
        """A terminal slot (the lowest free) and, if asked, an aligned one (the highest)."""
        assert holder not in self.slots, f"{holder} already holds slots"
        need = 2 if aligned else 1
        if need > len(self._free):
            raise OutOfCacheError(f"Mamba state pool: need {need} slots, {len(self._free)} free")
        terminal = min(self._free)
        self._free.remove(terminal)
        snapshot = None
        if aligned:
            snapshot = max(self._free)
            self._free.remove(snapshot)
        self.slots[holder] = HolderSlots(terminal, snapshot)
        return self.slots[holder]

    def slot_of(self, holder: Holder) -> int:
        """The holder's terminal (running) slot."""
        return self.slots[holder].terminal

    def transfer(self, src: Holder, dst: Holder) -> None:
        assert dst not in self.slots, f"{dst} already holds slots"
        self.slots[dst] = self.slots.pop(src)

    def free(self, holder: Holder) -> None:
        held = self.slots.pop(holder, None)
        if held is not None:
            self._free.update(held)

    def usage(self) -> CacheUsage:
        in_use = sum(len(s) for h, s in self.slots.items() if not h.kind.cached)
        cached = sum(len(s) for h, s in self.slots.items() if h.kind.cached)
        return CacheUsage(free=len(self._free), cached=cached, in_use=in_use, total=self.layout.num_slots)
