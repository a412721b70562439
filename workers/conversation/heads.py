"""Committed heads: the retained state of a conversation after a turn, with LRU eviction.

A head holds (as `Holder.head`) the KV blocks of positions [0, state_len) and two Mamba
slots: the terminal state at state_len and the state at the last aligned position
(aligned_len = state_len rounded down to the alignment). Heads are immutable; a turn that
continues one copies what it will write (tail block, Mamba state).

Eviction drops least-recently-used heads that no in-flight turn depends on (`pins == 0`);
the ledger keeps their token ids, so the next turn recomputes them (counted as a miss).
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
        kv.reclaim = lambda n: self._evict_while(lambda: kv.pool.num_free < n)
        states.reclaim = lambda n: self._evict_while(lambda: states.num_free < n)

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
        assert head.pins == 0, f"dropping head {head.id} that an in-flight turn uses"
        del self._heads[head.id]
        self.kv.free(head.holder)
        self.states.free(head.holder)

    def bytes_used(self) -> int:
        blocks = {b for h, t in self.kv.tables.items() if h.kind is HolderKind.HEAD for b in t}
        slots = sum(len(s) for h, s in self.states.slots.items() if h.kind is HolderKind.HEAD)
        return len(blocks) * self.kv.layout.block_bytes + slots * self.states.layout.slot_bytes

    def enforce_budget(self) -> None:
        self._evict_while(lambda: self.bytes_used() > self.budget_bytes)

    def _evict_while(self, short: Callable[[], bool]) -> None:
        while short():
            victim = next((h for h in self._heads.values() if h.pins == 0), None)
            if victim is None:
                return
            self.drop(victim)
            self.evictions += 1
            self.on_evict(victim)
