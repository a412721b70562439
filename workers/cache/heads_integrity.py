"""The head manager's invariants (`HeadManager.check`), asserted after engine steps in debug runs
and tests. A mixin of `HeadManager` (heads.py), which holds the state it reads."""

from __future__ import annotations

from collections import OrderedDict

from workers.cache.head_records import CommittedHead, PendingMark, PreparedState
from workers.cache.kv_blocks import KVCacheManager
from workers.cache.mamba_slots import MambaStateManager
from workers.cache.prefix_index import PrefixIndex
from workers.request import RequestStatus
from workers.state_names import Holder, HolderKind


class Integrity:
    kv: KVCacheManager
    states: MambaStateManager
    heads: OrderedDict[Holder, CommittedHead]
    checkpoints: OrderedDict[Holder, CommittedHead]
    prepared: dict[Holder, PreparedState]
    marking: dict[str, list[PendingMark]]
    index: PrefixIndex[CommittedHead]
    _by_turn: dict[tuple[str, int], CommittedHead]

    def check(self) -> None:
        """Every block or slot held by a head or prepared turn belongs to one this manager knows."""
        marks = {p.holder: p for held in self.marking.values() for p in held}
        for kind, known in (
            (HolderKind.HEAD, self.heads), (HolderKind.PREPARED, self.prepared),
            (HolderKind.CHECKPOINT, self.checkpoints), (HolderKind.MARK, marks),
        ):
            for what, pool in (("KV blocks", self.kv), ("Mamba slots", self.states)):
                stray = [h for h in pool.holders() if h.kind is kind and h not in known]
                assert not stray, f"{what} held by unknown {kind.value} holders (a leak): {stray}"
            for holder in known:
                assert holder in self.states.slots, f"{holder} holds no state slot"
        assert {(h.conversation_key, h.turn): h for h in self.heads.values()} == self._by_turn, "head index"
        # A pin that outlives its request keeps the head from eviction forever (a leak).
        awaiting = {(p.base.holder, p.request_id) for p in self.prepared.values() if p.base is not None}
        for head in [*self.heads.values(), *self.checkpoints.values()]:
            stale = [
                rid for rid, r in head.pinned_by.items()
                if r.status is RequestStatus.FINISHED and (head.holder, rid) not in awaiting
            ]
            assert not stale, f"{head.holder} pinned by requests that ended: {stale}"
        bs = self.kv.block_size
        for head in [*self.heads.values(), *self.checkpoints.values()]:
            assert len(self.kv.table(head.holder)) == -(-head.state_len // bs), f"head table vs state_len: {head}"
            assert 0 <= head.aligned_len <= head.state_len, head
            assert head.prefix is None or head.prefix.length == head.state_len, f"prefix key vs state_len: {head}"
        named = {(key, id(h)) for key, held in self.index.items() for h in held}
        holding = {(h.prefix, id(h)) for h in [*self.heads.values(), *self.checkpoints.values()] if h.prefix}
        assert named == holding, "prefix index vs the held heads and checkpoints"
        for pending in marks.values():
            assert pending.holder not in self.kv.tables, f"a checkpoint being made holds KV blocks: {pending}"
