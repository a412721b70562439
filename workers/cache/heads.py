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
recently used of all.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.state_names import Holder, HolderKind, PrefixKey
from workers.cache.kv_blocks import KVCacheManager
from workers.cache.mamba_slots import MambaStateManager
from workers.cache.prefix_index import PrefixIndex
from workers.errors import HeadExistsError
from workers.request import CheckpointMark, HeadAttachment, Request, RequestStatus, ReuseSource

log = logging.getLogger(__name__)
WITHDRAWN_KEPT = 4096  # withdrawals not yet drained by the worker


@dataclass
class CommittedHead:
    holder: Holder
    conversation_key: str
    turn: int
    version: int  # the ledger version this head's state belongs to
    state_len: int
    aligned_len: int
    canonical_window: int = 0  # see HeadAttachment
    pinned_by: dict[str, Request] = field(default_factory=dict)  # request id -> the turn continuing it
    last_used: float = field(default_factory=time.monotonic)
    prefix: PrefixKey | None = None  # the token prefix it covers, if named in the prefix index
    source: ReuseSource = ReuseSource.HEAD  # what a request attaching it reuses (metrics)
    hits: int = 0  # requests that attached it by prefix lookup
    superseded: bool = False  # a checkpoint a longer one of the same request chain replaced
    chain_end: bool = False  # a checkpoint of where a request ended (a chain's link, not a mark)
    awaiting_tool: bool = False  # its reply ended in tool calls: the next request brings their results

    @property
    def pins(self) -> int:
        return len(self.pinned_by)

    def attachment(self) -> HeadAttachment:
        return HeadAttachment(self.holder, self.state_len, self.aligned_len, self.canonical_window)


@dataclass
class PreparedState:
    holder: Holder
    request_id: str
    state_len: int
    aligned_len: int
    base: CommittedHead | None  # stays pinned until the turn is resolved
    deadline: float
    on_expire: Callable[[PreparedState], None] | None = None
    canonical_window: int = 0  # see HeadAttachment
    prefix: PrefixKey | None = None  # the head it becomes is named by it
    awaiting_tool: bool = False  # see CommittedHead


@dataclass
class PendingMark:
    """A checkpoint being made: its slot receives the Mamba state when the prefill passes the
    mark; then it shares the request's blocks up to there and joins the index."""

    holder: Holder
    request_id: str
    mark: CheckpointMark
    slot: int
    scheduled: bool = False  # a chunk cut its prefill there (else the slot never got the state)


class HeadManager:
    def __init__(
        self,
        kv: KVCacheManager,
        states: MambaStateManager,
        budget_bytes: int,
        prepared_timeout_s: float,
        checkpoint_budget_bytes: int = 0,
        checkpoint_slots: int = 0,
        tool_pause_s: float = 0.0,
    ):
        self.kv = kv
        self.tool_pause_s = tool_pause_s
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
            "tool_pause_evictions": 0,  # states evicted while waiting for tool results (memory ran out)
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
        checkpoint = self._add_checkpoint(holder, state_len, key, ReuseSource.PREFIX)
        checkpoint.chain_end = True
        checkpoint.awaiting_tool = awaiting_tool
        return checkpoint

    def _add_checkpoint(self, holder: Holder, state_len: int, key: PrefixKey, source: ReuseSource) -> CommittedHead:
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
        request its admission)."""
        if not self.checkpoint_budget_bytes:
            return False
        short = lambda: self._checkpoints_over(extra_slots=1) or self.states.num_free < 1  # noqa: E731
        self._evict_while(short, lambda h: False, protect, kind=HolderKind.CHECKPOINT)
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
        return self._add_checkpoint(holder, position, key, pending.mark.source)

    def drop_marks(self, request_id: str) -> None:
        """The request stopped (finished, failed, preempted) before reaching these marks."""
        for pending in self.marking.pop(request_id, []):
            self.states.free(pending.holder)

    def _forget_mark(self, pending: PendingMark) -> None:
        marks = self.marking[pending.request_id]
        marks.remove(pending)
        if not marks:
            del self.marking[pending.request_id]

    def _checkpoints_over(self, extra_slots: int = 0) -> bool:
        """Checkpoints and open marks (plus `extra_slots` more) past their bytes or slots."""
        marks = sum(len(m) for m in self.marking.values()) + extra_slots
        slots = sum(len(s) for h, s in self.states.slots.items() if h.kind is HolderKind.CHECKPOINT) + marks
        used = self.bytes_used(HolderKind.CHECKPOINT) + marks * self.states.layout.slot_bytes
        return slots > self.checkpoint_slots or used > self.checkpoint_budget_bytes

    def _detach(self, head: CommittedHead) -> None:
        """Requests still pinning a head that goes: queued ones recompute from their prompt."""
        for request in head.pinned_by.values():
            if request.head is not None and request.head.holder == head.holder:
                request.head = None
                self.counters["detached"] += 1
        head.pinned_by.clear()

    def bytes_used(self, kind: HolderKind = HolderKind.HEAD) -> int:
        """Bytes the holders of `kind` reference (a block shared by several is counted once)."""
        blocks = {b for h, t in self.kv.tables.items() if h.kind is kind for b in t}
        slots = sum(len(s) for h, s in self.states.slots.items() if h.kind is kind)
        return len(blocks) * self.kv.layout.block_bytes + slots * self.states.layout.slot_bytes

    def enforce_budget(self) -> None:
        self._evict_while(lambda: self.bytes_used() > self.budget_bytes, lambda h: False, kind=HolderKind.HEAD)
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
    ) -> None:
        while short():
            candidates = [h for h in self.eviction_order(kind) if h.holder != protect]
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

    def eviction_order(self, kind: HolderKind | None) -> list[CommittedHead]:
        """Superseded checkpoints hit at most once first, then least recently used first; states
        waiting for tool results (within tool_pause_s) last of all: an agent loop's pause for
        its tools is not idleness, its next step comes back for this state."""
        if kind is HolderKind.HEAD or not self.checkpoints:
            order = list(self.heads.values())
        else:
            checkpoints = list(self.checkpoints.values())
            spent = [c for c in checkpoints if c.superseded and c.hits <= 1]
            rest = checkpoints if kind is HolderKind.CHECKPOINT else [*self.heads.values(), *checkpoints]
            order = spent + sorted((h for h in rest if not (h.superseded and h.hits <= 1)), key=lambda h: h.last_used)
        if not self.tool_pause_s:
            return order
        now = time.monotonic()
        paused = [h for h in order if self._in_tool_pause(h, now)]
        return [h for h in order if not self._in_tool_pause(h, now)] + paused if paused else order

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

    # -- integrity ------------------------------------------------------------------------------
    def check(self) -> None:
        """Every block or slot held by a head or prepared turn belongs to one this manager knows."""
        marks = {p.holder: p for held in self.marking.values() for p in held}
        for kind, known in (
            (HolderKind.HEAD, self.heads), (HolderKind.PREPARED, self.prepared),
            (HolderKind.CHECKPOINT, self.checkpoints), (HolderKind.MARK, marks),
        ):
            for what, manager in (("KV blocks", self.kv), ("Mamba slots", self.states)):
                stray = [h for h in manager.holders() if h.kind is kind and h not in known]
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
