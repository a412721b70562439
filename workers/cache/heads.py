"""Committed heads and prepared turns: the third cache manager, behind the coordinator.

A head holds (as `Holder.head(serial)`) the KV blocks of positions [0, state_len) and two
Mamba slots: the terminal state at state_len and the state at the last aligned position.
Heads are immutable; a turn that continues one copies what it will write (tail block, Mamba
state). A prepared turn (`Holder.prepared(serial)`) is a finished turn's state awaiting the
verdict of the cache service:

    request R finishes (STOP/LENGTH, keep=PREPARE)
        R's blocks + slots ──transfer──> prepared P        base head H untouched, still pinned
    commit(P)   P ──transfer──> head H' (no copy)          H unpinned
    abandon(P)  P freed                                    H byte-identical, unpinned
    timeout     = abandon, counted

Eviction drops least-recently-used heads that nothing pins; the ledger keeps their token
ids, so the next turn recomputes them (a miss). Only when the pools are short and nothing
runs may a head pinned solely by queued (not admitted) requests go: they are detached and
recompute. Without this, queued turns pinning heads could starve the pool (a deadlock).
A head pinned by an admitted or prepared turn, or by the request being admitted, never goes.

Prefix checkpoints (`Holder.checkpoint`-kind heads that no conversation owns) are the state
at a message boundary of some prompt, or at the end of a finished stateless request. Heads and
checkpoints are named by their token prefix in one `PrefixIndex` (under their cache scope),
live in the same LRU and follow the same pin rules; checkpoints have a byte budget of their own.
Eviction takes first the checkpoints a longer one of the same request chain superseded (hit at
most once: a shared system prompt is hit by every conversation and stays), then the least
recently used of all; states waiting for their tools' results (tool_pause_s) go last, and a
mark never evicts the most recent of them within `tool_pause_share` of the checkpoints' budget.

Here: the heads' names, pins, checkpoints, marks and prepared turns. The records are in
head_records.py, the eviction order and budgets in eviction.py, the invariants in
heads_integrity.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque

from workers.cache.eviction import Eviction
from workers.cache.head_records import CommittedHead, PendingMark, PreparedState
from workers.cache.heads_integrity import Integrity
from workers.cache.kv_blocks import KVCacheManager
from workers.cache.mamba_slots import MambaStateManager
from workers.cache.prefix_index import PrefixIndex
from workers.errors import HeadExistsError
from workers.request import CheckpointMark, HeadAttachment, Request, ReuseSource
from workers.state_names import Holder, HolderKind, PrefixKey

__all__ = ["CommittedHead", "HeadManager", "PendingMark", "PreparedState"]

log = logging.getLogger(__name__)
WITHDRAWN_KEPT = 4096  # withdrawals not yet drained by the worker


class HeadManager(Eviction, Integrity):
    def __init__(
        self,
        kv: KVCacheManager,
        states: MambaStateManager,
        budget_bytes: int,
        prepared_timeout_s: float,
        checkpoint_budget_bytes: int = 0,
        checkpoint_slots: int = 0,
        tool_pause_s: float = 0.0,
        tool_pause_share: float = 0.5,
    ):
        self.kv = kv
        self.tool_pause_s = tool_pause_s
        self.tool_pause_share = tool_pause_share
        self.states = states
        self.budget_bytes = budget_bytes
        # Checkpoints (and marks) hold at most this many bytes and slots: the slots of the pool
        # sized for them, never those of requests and heads. Either 0: no checkpoints are kept.
        self.checkpoint_budget_bytes = checkpoint_budget_bytes if checkpoint_slots else 0
        self.checkpoint_slots = checkpoint_slots
        self.prepared_timeout_s = prepared_timeout_s
        self.heads: OrderedDict[Holder, CommittedHead] = OrderedDict()  # LRU first
        self.checkpoints: OrderedDict[Holder, CommittedHead] = OrderedDict()  # LRU first
        self.index: PrefixIndex[CommittedHead] = PrefixIndex()
        self.index_version = 0  # bumped whenever a state is named: a lookup that missed may now hit
        # Checkpoints' names no state holds any more, for the worker to withdraw from the prefix
        # index (drained from its own thread: a deque's append and popleft are thread-safe). Bounded:
        # a withdrawal lost to it leaves a hint that expires with the index's TTL.
        self.withdrawn: deque[PrefixKey] = deque(maxlen=WITHDRAWN_KEPT)
        self.marking: dict[str, list[PendingMark]] = {}  # request id -> its marks, by position
        self._by_turn: dict[tuple[str, int], CommittedHead] = {}
        self.prepared: dict[Holder, PreparedState] = {}
        self._serials = itertools.count(1)
        self.counters = {
            "evictions": 0, "detached": 0, "prepared_expired": 0, "checkpoint_evictions": 0,
            "prefix_hits": 0, "prefix_misses": 0, "checkpoints_made": 0,
            # states evicted while waiting for tool results (memory ran out, or a mark took one
            # past tool_pause_share of the checkpoints' budget)
            "tool_pause_evictions": 0,
        }

    # -- lookup -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.heads)

    def all(self) -> list[CommittedHead]:
        return list(self.heads.values())

    def find(self, key: str, turn: int, touch: bool = True) -> CommittedHead | None:
        head = self._by_turn.get((key, turn))
        if head is not None and touch:
            self.touch(head)
        return head

    def latest(self, key: str, at_most: int | None = None) -> CommittedHead | None:
        """The conversation's held head of the highest turn (up to `at_most` if given), touched."""
        turns = [h.turn for h in self.of_conversation(key) if at_most is None or h.turn <= at_most]
        return self.find(key, max(turns)) if turns else None

    def of_conversation(self, key: str) -> list[CommittedHead]:
        return [h for h in self.heads.values() if h.conversation_key == key]

    def new_holder(self, kind: HolderKind) -> Holder:
        return Holder(kind, next(self._serials))

    # -- pins ---------------------------------------------------------------------------------
    def pin(self, head: CommittedHead, request: Request) -> None:
        head.pinned_by[request.request_id] = request

    def unpin(self, head: CommittedHead | None, request_id: str) -> None:
        if head is not None:
            head.pinned_by.pop(request_id, None)

    def head_of(self, attachment: HeadAttachment | None) -> CommittedHead | None:
        if attachment is None:
            return None
        return self.heads.get(attachment.holder) or self.checkpoints.get(attachment.holder)

    # -- heads --------------------------------------------------------------------------------
    def add(self, head: CommittedHead) -> None:
        if head.holder.kind is HolderKind.CHECKPOINT:
            assert head.holder not in self.checkpoints and head.prefix is not None
            self.checkpoints[head.holder] = head
        else:
            assert head.holder not in self.heads and (head.conversation_key, head.turn) not in self._by_turn
            self.heads[head.holder] = head
            self._by_turn[head.conversation_key, head.turn] = head
        if head.prefix is not None:
            self.index.add(head.prefix, head)
            self.index_version += 1

    def unname(self, head: CommittedHead) -> None:
        """Take a head out of the prefix index (its state no longer covers the tokens it was named by)."""
        if head.prefix is not None:
            self.index.remove(head.prefix, head)
            head.prefix = None

    def drop(self, head: CommittedHead) -> None:
        """Release a head (rewind, delete, replaced). Turns pinning it keep their own copies."""
        self._detach(head)
        if head.holder.kind is HolderKind.CHECKPOINT:
            del self.checkpoints[head.holder]
        else:
            del self.heads[head.holder]
            del self._by_turn[head.conversation_key, head.turn]
        if head.prefix is not None:
            self.index.remove(head.prefix, head)
            if head.holder.kind is HolderKind.CHECKPOINT and head.prefix not in self.index:
                self.withdrawn.append(head.prefix)
        self.kv.free(head.holder)
        self.states.free(head.holder)

    # -- prefix lookup --------------------------------------------------------------------------
    def longest_prefix(self, scope: str, token_ids: list[int], max_length: int) -> CommittedHead | None:
        """The held state (head or checkpoint) of the longest prefix of `token_ids` (at most
        max_length tokens) under `scope`, counted as a hit and touched; None is a miss."""
        found = self.index.longest(scope, token_ids, max_length)
        if found is None:
            self.counters["prefix_misses"] += 1
            return None
        state = max(found[1], key=lambda h: h.last_used)
        state.hits += 1
        self.counters["prefix_hits"] += 1
        self.touch(state)
        return state

    def touch(self, head: CommittedHead) -> None:
        head.last_used = time.monotonic()
        (self.checkpoints if head.holder.kind is HolderKind.CHECKPOINT else self.heads).move_to_end(head.holder)

    def keep_checkpoint(self, src: Holder, state_len: int, key: PrefixKey,
                        awaiting_tool: bool = False) -> CommittedHead | None:
        """`src`'s state (its KV already trimmed to state_len) becomes a checkpoint of where a
        request ended, without a copy; None (src untouched) if that prefix is already held or
        checkpoints are off. The caller enforces the budget after (it may evict this one)."""
        if key in self.index or not self.checkpoint_budget_bytes:
            return None
        holder = self.new_holder(HolderKind.CHECKPOINT)
        self._move(src, holder)
        checkpoint = self.add_checkpoint(holder, state_len, key, ReuseSource.PREFIX)
        checkpoint.chain_end = True
        checkpoint.awaiting_tool = awaiting_tool
        return checkpoint

    def add_checkpoint(self, holder: Holder, state_len: int, key: PrefixKey,
                       source: ReuseSource = ReuseSource.PREFIX) -> CommittedHead:
        checkpoint = CommittedHead(holder, "", 0, 0, state_len, 0, prefix=key, source=source)
        self.add(checkpoint)
        self.counters["checkpoints_made"] += 1
        return checkpoint

    def holds(self, checkpoint: CommittedHead) -> bool:
        return self.checkpoints.get(checkpoint.holder) is checkpoint

    # -- checkpoints being made -----------------------------------------------------------------
    def room_for_mark(self, protect: Holder | None) -> bool:
        """Room for one more mark within the checkpoints' bytes and slots, evicting other unpinned
        checkpoints only (a mark is optional: it never costs a conversation its head or a
        request its admission). States waiting for their tools' results go last, and those
        within `tool_pause_share` of the budget (the most recently used) never: a mark may help
        some later request, while such a state is what an agent loop's next step attaches. Past
        that share a mark takes the oldest, so ends nobody resumes (under a salt sent once)
        cannot keep a replica from holding any shared prefix for tool_pause_s."""
        if not self.checkpoint_budget_bytes:
            return False
        short = lambda: self._checkpoints_over(extra_slots=1) or self.states.num_free < 1  # noqa: E731
        spared = self._tool_pause_spared(time.monotonic())
        self._evict_while(short, lambda h: False, protect, kind=HolderKind.CHECKPOINT,
                          spare=lambda h: h.holder in spared)
        return not short()

    def room_for_checkpoint(self, blocks: int, slots: int, protect: Holder) -> bool:
        """Room for a checkpoint imported from the tier (`blocks` new KV blocks, `slots` state
        slots) within the checkpoints' budget and the free pools, by the rule of a mark (an
        import is as optional): other unpinned checkpoints only, sparing the states waiting for
        their tools within tool_pause_share."""
        if not self.checkpoint_budget_bytes:
            return False
        extra = blocks * self.kv.layout.block_bytes

        def short() -> bool:
            return (self._checkpoints_over(extra_slots=slots, extra_bytes=extra)
                    or self.kv.num_free < blocks or self.states.num_free < slots)

        spared = self._tool_pause_spared(time.monotonic())
        self._evict_while(short, lambda h: False, protect, kind=HolderKind.CHECKPOINT,
                          spare=lambda h: h.holder in spared)
        return not short()

    def open_mark(self, request_id: str, mark: CheckpointMark) -> PendingMark:
        """A slot for the state at the mark (the caller made room for it)."""
        holder = self.new_holder(HolderKind.MARK)
        held = self.states.allocate(holder, aligned=False)
        pending = PendingMark(holder, request_id, mark, held.terminal)
        marks = self.marking.setdefault(request_id, [])
        marks.append(pending)
        marks.sort(key=lambda p: p.mark.position)
        return pending

    def marks_of(self, request_id: str) -> list[PendingMark]:
        """The request's open marks, by position (the list itself: O(1) for a request with none)."""
        return self.marking.get(request_id, [])

    def close_mark(self, pending: PendingMark, request_table: list[int]) -> CommittedHead | None:
        """The prefill passed the mark: a checkpoint if its state was snapshot and is new."""
        self._forget_mark(pending)
        position, key = pending.mark.position, pending.mark.key
        if not pending.scheduled or key is None or key in self.index:
            self.states.free(pending.holder)
            return None
        holder = self.new_holder(HolderKind.CHECKPOINT)
        self.states.transfer(pending.holder, holder)
        self.kv.share(holder, request_table[: -(-position // self.kv.block_size)])
        return self.add_checkpoint(holder, position, key, pending.mark.source)

    def drop_marks(self, request_id: str) -> None:
        """The request stopped (finished, failed, preempted) before reaching these marks."""
        for pending in self.marking.pop(request_id, []):
            self.states.free(pending.holder)

    def _forget_mark(self, pending: PendingMark) -> None:
        marks = self.marking[pending.request_id]
        marks.remove(pending)
        if not marks:
            del self.marking[pending.request_id]

    def _detach(self, head: CommittedHead) -> None:
        """Requests still pinning a head that goes: queued ones recompute from their prompt."""
        for request in head.pinned_by.values():
            if request.head is not None and request.head.holder == head.holder:
                request.head = None
                self.counters["detached"] += 1
        head.pinned_by.clear()

    # -- prepared turns -------------------------------------------------------------------------
    def prepare(
        self, request: Request, base: CommittedHead | None, now: float, prefix: PrefixKey | None = None
    ) -> PreparedState:
        """A finished request's state, kept for its verdict (no copy; KV trimmed to state_len).
        All-or-nothing: if a move fails, the request still holds everything."""
        src = Holder.request(request.request_id)
        holder = self.new_holder(HolderKind.PREPARED)
        state_len = request.num_computed_tokens
        self.kv.truncate(src, state_len)  # blocks past state_len hold nothing a head needs
        self._move(src, holder)
        prepared = PreparedState(
            holder, request.request_id, state_len, request.aligned_len, base, now + self.prepared_timeout_s,
            canonical_window=request.tile_window if request.deterministic else 0, prefix=prefix,
            awaiting_tool=request.awaiting_tool,
        )
        self.prepared[holder] = prepared
        return prepared

    def commit(
        self, prepared: PreparedState, key: str, turn: int, version: int, replacing: CommittedHead | None = None
    ) -> CommittedHead:
        """The prepared state becomes the head of (key, turn) without a copy (all-or-nothing).

        `replacing`: the head (key, turn) has now (a regenerated turn, a canonical rebuild); it
        is dropped only once the state has moved, so a failed commit leaves it intact."""
        current = self._by_turn.get((key, turn))
        if current is not None and current is not replacing:  # checked before anything moves
            raise HeadExistsError(f"turn {turn} of conversation {key} already has a head")
        holder = self.new_holder(HolderKind.HEAD)
        self._move(prepared.holder, holder)
        del self.prepared[prepared.holder]
        self.unpin(prepared.base, prepared.request_id)
        if current is not None:
            self.drop(current)
        head = CommittedHead(
            holder, key, turn, version, prepared.state_len, prepared.aligned_len, prepared.canonical_window,
            prefix=prepared.prefix, awaiting_tool=prepared.awaiting_tool,
        )
        self.add(head)
        return head

    def _move(self, src: Holder, dst: Holder) -> None:
        """Hand src's blocks and slots to dst, both or neither."""
        self.kv.transfer(src, dst)
        try:
            self.states.transfer(src, dst)
        except BaseException:
            self.kv.transfer(dst, src)
            raise

    def release(self, prepared: PreparedState) -> None:
        """Abandon: free the prepared state; the base head was never written."""
        del self.prepared[prepared.holder]
        self.unpin(prepared.base, prepared.request_id)
        self.kv.free(prepared.holder)
        self.states.free(prepared.holder)

    def expire(self, now: float) -> list[PreparedState]:
        expired = [p for p in self.prepared.values() if p.deadline <= now]
        for prepared in expired:
            self.release(prepared)
            self.counters["prepared_expired"] += 1
            if prepared.on_expire is None:
                continue
            try:
                prepared.on_expire(prepared)
            except Exception:  # the owner's failure: the state is released, the engine goes on
                log.exception("on_expire of prepared turn %s failed", prepared.request_id)
        return expired

    def prepared_of(self, request_id: str) -> PreparedState | None:
        return next((p for p in self.prepared.values() if p.request_id == request_id), None)

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self.prepared.values()), default=None)
