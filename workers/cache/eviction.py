"""Which heads and checkpoints go when memory or a budget runs short (`HeadManager`'s eviction).

A mixin of `HeadManager` (heads.py), which holds the state it reads: the LRU maps of heads and
checkpoints, the marks being made, the pools, the budgets and the counters. The rules are in
heads.py's docstring; the order is in `eviction_order`; the states waiting for their tools
that a mark may not evict (the newest, within `tool_pause_share` of the checkpoints' budget)
in `_tool_pause_spared`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from workers.cache.head_records import CommittedHead, PendingMark
from workers.cache.kv_blocks import KVCacheManager
from workers.cache.mamba_slots import MambaStateManager
from workers.request import RequestStatus
from workers.state_names import Holder, HolderKind


class Eviction:
    kv: KVCacheManager
    states: MambaStateManager
    heads: OrderedDict[Holder, CommittedHead]
    checkpoints: OrderedDict[Holder, CommittedHead]
    marking: dict[str, list[PendingMark]]
    budget_bytes: int
    checkpoint_budget_bytes: int
    checkpoint_slots: int
    tool_pause_s: float
    tool_pause_share: float
    counters: dict[str, int]

    def drop(self, head: CommittedHead) -> None:  # defined by HeadManager: it unnames and frees the head
        raise NotImplementedError

    def _checkpoints_over(self, extra_slots: int = 0, extra_bytes: int = 0) -> bool:
        """Checkpoints and open marks (plus `extra_slots` more slots and `extra_bytes` more KV
        bytes) past their bytes or slots."""
        marks = sum(len(m) for m in self.marking.values()) + extra_slots
        slots = sum(len(s) for h, s in self.states.slots.items() if h.kind is HolderKind.CHECKPOINT) + marks
        used = self.bytes_used(HolderKind.CHECKPOINT) + marks * self.states.layout.slot_bytes + extra_bytes
        return slots > self.checkpoint_slots or used > self.checkpoint_budget_bytes

    def bytes_used(self, kind: HolderKind = HolderKind.HEAD) -> int:
        """Bytes the holders of `kind` reference (a block shared by several is counted once)."""
        blocks = {b for h, t in self.kv.tables.items() if h.kind is kind for b in t}
        slots = sum(len(s) for h, s in self.states.slots.items() if h.kind is kind)
        return len(blocks) * self.kv.layout.block_bytes + slots * self.states.layout.slot_bytes

    def enforce_budget(self, protect: Holder | None = None) -> None:
        self._evict_while(lambda: self.bytes_used() > self.budget_bytes, lambda h: False, protect, kind=HolderKind.HEAD)
        self.enforce_checkpoint_budget()

    def enforce_checkpoint_budget(self) -> None:
        self._evict_while(self._checkpoints_over, lambda h: False, kind=HolderKind.CHECKPOINT)

    def make_room(self, blocks: int, slots: int, protect: Holder | None, idle: bool, admitted: set[str]) -> bool:
        """Evict until `blocks` KV blocks and `slots` state slots are free; False if impossible.

        `protect`: the head the caller is about to read (never evicted here). `idle`: nothing
        runs, so heads pinned only by requests that were never admitted may go too."""

        def short() -> bool:
            return self.kv.num_free < blocks or self.states.num_free < slots

        def takeable(head: CommittedHead) -> bool:
            # Never the base of an admitted or prepared (finished, awaiting its verdict) turn.
            return idle and all(
                r.status is RequestStatus.WAITING and rid not in admitted for rid, r in head.pinned_by.items()
            )

        self._evict_while(short, takeable, protect)
        return not short()

    def _evict_while(
        self,
        short: Callable[[], bool],
        take_pinned: Callable[[CommittedHead], bool],
        protect: Holder | None = None,
        kind: HolderKind | None = None,
        spare: Callable[[CommittedHead], bool] = lambda h: False,
    ) -> None:
        while short():
            candidates = [h for h in self.eviction_order(kind) if h.holder != protect and not spare(h)]
            victim = next((h for h in candidates if h.pins == 0), None)
            if victim is None:
                victim = next((h for h in candidates if take_pinned(h)), None)
            if victim is None:
                return
            if self._in_tool_pause(victim, time.monotonic()):
                self.counters["tool_pause_evictions"] += 1
            self.drop(victim)
            is_checkpoint = victim.holder.kind is HolderKind.CHECKPOINT
            self.counters["checkpoint_evictions" if is_checkpoint else "evictions"] += 1

    def _in_tool_pause(self, head: CommittedHead, now: float) -> bool:
        """Waiting for its tools' results: not yet taken up (a checkpoint a request attached, or
        one a longer link superseded, has had its results back)."""
        return (head.awaiting_tool and not head.superseded and head.hits == 0
                and now - head.last_used < self.tool_pause_s)

    def _tool_pause_spared(self, now: float) -> set[Holder]:
        """The checkpoints waiting for their tools that a mark may not evict: the most recently
        used first, while together they hold at most `tool_pause_share` of the checkpoints' bytes
        and of their slots. A mark takes the older ones beyond that share, least recently used
        first, so a tenant's shared prefix is still kept when many loops wait at once.

        An end never attached again (its salt was sent once) stays protected until its pause
        runs out, as today: nothing tells it from a loop whose tools are slow, so no guess; the
        share bounds what such ends hold meanwhile, and, being the oldest, they are the first a
        mark takes once the share is full."""
        waiting = sorted((c for c in self.checkpoints.values() if self._in_tool_pause(c, now)),
                         key=lambda c: c.last_used, reverse=True)
        max_bytes = self.tool_pause_share * self.checkpoint_budget_bytes
        max_slots = self.tool_pause_share * self.checkpoint_slots
        spared: set[Holder] = set()
        blocks: set[int] = set()  # a block shared by several ends is counted once, as in the budget
        slots = 0
        for end in waiting:
            new_blocks = set(self.kv.table(end.holder)) - blocks  # on the engine thread per mark: no set copies
            more_slots = slots + len(self.states.slots.get(end.holder, ()))
            held = (len(blocks) + len(new_blocks)) * self.kv.layout.block_bytes + more_slots * self.states.layout.slot_bytes
            if held > max_bytes or more_slots > max_slots:
                break
            spared.add(end.holder)
            blocks |= new_blocks
            slots = more_slots
        return spared

    def eviction_order(self, kind: HolderKind | None) -> list[CommittedHead]:
        """Superseded checkpoints hit at most once first, then heads the state tier holds a copy
        of (the next turn imports one, where a head held only here is recomputed from its
        ledger), then least recently used first; states waiting for tool results (within
        tool_pause_s) last of all: an agent loop's pause for its tools is not idleness, its
        next step comes back for this state."""
        if kind is HolderKind.HEAD or not self.checkpoints:
            order = sorted(self.heads.values(), key=lambda h: not h.in_tier)  # stable: least recently used first
        else:
            checkpoints = list(self.checkpoints.values())
            spent = [c for c in checkpoints if c.superseded and c.hits <= 1]
            rest = checkpoints if kind is HolderKind.CHECKPOINT else [*self.heads.values(), *checkpoints]
            order = spent + sorted((h for h in rest if not (h.superseded and h.hits <= 1)),
                                   key=lambda h: (not h.in_tier, h.last_used))
        if not self.tool_pause_s:
            return order
        now = time.monotonic()
        paused = [h for h in order if self._in_tool_pause(h, now)]
        return [h for h in order if not self._in_tool_pause(h, now)] + paused if paused else order
