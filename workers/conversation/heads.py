"""Committed heads: the retained state of a conversation after a turn, with LRU eviction.

A head holds (as `Holder.head`) the KV blocks of positions [0, state_len) and two Mamba
slots: the terminal state at state_len and the state at the last aligned position
(aligned_len = state_len rounded down to the alignment). Heads are immutable; a turn that
continues one copies what it will write (tail block, Mamba state).

Eviction drops least-recently-used heads that no in-flight turn depends on (`pins == 0`);
the ledger keeps their token ids, so the next turn recomputes them (counted as a miss).
Only when the pools are short, nothing is running and nothing else is left does it take a
pinned head whose turns are all still queued: they are detached and recompute (`ConversationCache._on_evict`).
Without this, queued turns pinning heads could starve the pool for everyone (a deadlock).
A head whose turn is running is never taken.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.cache.holders import Holder, HolderKind
from workers.cache.kv_blocks import KVCacheManager
from workers.cache.mamba_slots import MambaStateManager


@dataclass
class CommittedHead:
    holder: Holder
    conversation_key: str
    turn: int
    state_len: int
    aligned_len: int
    pins: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> tuple[str, int]:
        return self.conversation_key, self.turn


class HeadStore:
    def __init__(self, kv: KVCacheManager, states: MambaStateManager, budget_bytes: int):
        self.kv = kv
        self.states = states
        self.budget_bytes = budget_bytes
        self._heads: OrderedDict[tuple[str, int], CommittedHead] = OrderedDict()  # LRU first
        self.evictions = 0
        self.on_evict: Callable[[CommittedHead], None] = lambda head: None
        # Whether a pinned head may still go when the pools are short (its turns only queued).
        self.may_take_pinned: Callable[[CommittedHead], bool] = lambda head: False
        kv.reclaim = lambda n: self._evict_while(lambda: kv.pool.num_free < n, take_pinned=True)
        states.reclaim = lambda n: self._evict_while(lambda: states.num_free < n, take_pinned=True)

    def __len__(self) -> int:
        return len(self._heads)

    def get(self, key: str, turn: int) -> CommittedHead | None:
        head = self._heads.get((key, turn))
        if head is not None:
            head.last_used = time.monotonic()
            self._heads.move_to_end(head.id)
        return head

    def all(self) -> list[CommittedHead]:
        return list(self._heads.values())

    def of_conversation(self, key: str) -> list[CommittedHead]:
        return [h for h in self._heads.values() if h.conversation_key == key]

    def add(self, head: CommittedHead) -> None:
        assert head.id not in self._heads, f"head {head.id} exists"
        self._heads[head.id] = head
        self.enforce_budget()

    def drop(self, head: CommittedHead) -> None:
        del self._heads[head.id]
        self.kv.free(head.holder)
        self.states.free(head.holder)

    def bytes_used(self) -> int:
        blocks = {b for h, t in self.kv.tables.items() if h.kind is HolderKind.HEAD for b in t}
        slots = sum(len(s) for h, s in self.states.slots.items() if h.kind is HolderKind.HEAD)
        return len(blocks) * self.kv.layout.block_bytes + slots * self.states.layout.slot_bytes

    def enforce_budget(self) -> None:
        self._evict_while(lambda: self.bytes_used() > self.budget_bytes)

    def _evict_while(self, short: Callable[[], bool], take_pinned: bool = False) -> None:
        while short():
            victim = next((h for h in self._heads.values() if h.pins == 0), None)
            if victim is None and take_pinned:
                victim = next((h for h in self._heads.values() if self.may_take_pinned(h)), None)
            if victim is None:
                return
            self.on_evict(victim)  # detaches queued turns first (pins -> 0)
            self.drop(victim)
            self.evictions += 1
