"""One front for the three cache managers: what a request needs to run, attaching heads,
what happens to a request's state when it ends, and multi-step allocations.

Every multi-step allocation is all-or-nothing: count what is needed, make room (evicting
heads, never the ones being read), and only then mutate, so a failure changes nothing.

Attaching a committed head (state covers `L` tokens, block size 4, L = 10):

    head blocks:     [ b3 | b5 | b8: t8 t9 . . ]
    request blocks:  [ b3 | b5 | b9: t8 t9 . . ]   b3, b5 by reference; b8 -> b9 copied (tail COW)
    request slot:    s7 <- copy of the head's terminal slot

If L is block-aligned there is no tail to copy: all blocks are shared and the request's
first new token opens a fresh block.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from proto.contract import tokens_digest
from workers.cache.chunk_index import ChunkIndex
from workers.cache.heads import CommittedHead, HeadManager, PreparedState
from workers.cache.holders import HolderSlots
from workers.state_names import Holder, HolderKind, PrefixKey
from workers.cache.kv_blocks import KVCacheManager, blocks_for
from workers.cache.manager import CacheManager
from workers.cache.mamba_slots import MambaStateManager
from workers.errors import OutOfCacheError
from workers.request import CheckpointMark, KeepState, Request


@dataclass
class PendingCopies:
    """Tensor copies the runner performs before the next forward pass."""

    blocks: list[tuple[int, int]] = field(default_factory=list)
    slots: list[tuple[int, int]] = field(default_factory=list)
    zero_slots: list[int] = field(default_factory=list)  # fresh sequences start from the zero state

    def take(self) -> PendingCopies:
        taken = PendingCopies(self.blocks, self.slots, self.zero_slots)
        self.blocks, self.slots, self.zero_slots = [], [], []
        return taken


class CacheCoordinator:
    def __init__(
        self,
        kv: KVCacheManager,
        states: MambaStateManager,
        heads: HeadManager,
        copy_slots_now: Callable[[list[tuple[int, int]]], None],
    ):
        self.kv = kv
        self.states = states
        self.managers: tuple[CacheManager, ...] = (kv, states)  # one per cache type, same interface
        self.heads = heads
        # Copies between heads (fork) cannot wait for the next step: a later read of the
        # destination (an export, another fork) must see the state.
        self._copy_slots_now = copy_slots_now
        self.pending = PendingCopies()
        self.chunks = ChunkIndex(kv.pool)  # digests of full KV blocks, for incremental transfers
        self.admitted: set[str] = set()  # requests holding blocks and slots
        self.counters = {"cow_block_copies": 0, "state_copies": 0}

    # -- requests -------------------------------------------------------------------------------
    def register(self, request: Request) -> None:
        """A new request continuing a head pins it until the request is resolved."""
        head = self.heads.head_of(request.head)
        if head is not None:
            self.heads.pin(head, request)

    def attach_prefix(self, request: Request) -> None:
        """A waiting request without a head attaches the longest prefix of its prompt held under
        its scope (pinned from now on, like a conversation's head); looked up again only once
        something new was named since it missed."""
        if request.head is not None or not request.prefix_lookup or request.prefix_scope is None:
            return
        if request.prefixes_seen == self.heads.index_version:
            return
        request.prefixes_seen = self.heads.index_version
        prompt = request.prompt_token_ids
        found = self.heads.longest_prefix(request.prefix_scope, prompt, len(prompt) - 1)
        if found is not None:
            request.head = found.attachment()
            self.heads.pin(found, request)

    def held_prefix_length(self, request: Request) -> int:
        """How much of a waiting request's prompt it will start from: its head, or the longest prefix
        held under its scope (read-only: nothing pinned or counted; redone once something is named)."""
        if request.head is not None:
            return request.head.state_len
        if not request.prefix_lookup or request.prefix_scope is None:
            return 0
        version, length = request.held_estimate
        if version != self.heads.index_version:
            prompt = request.prompt_token_ids
            found = self.heads.index.longest(request.prefix_scope, prompt, len(prompt) - 1)
            length = found[0].length if found is not None else 0
            request.held_estimate = (self.heads.index_version, length)
        return length

    def try_admit(self, request: Request, num_new_tokens: int, idle: bool) -> bool:
        """Give a waiting request its slots and blocks for num_new_tokens more tokens,
        continuing its head if it still has one; False (nothing changed) if it cannot fit."""
        head = self.heads.head_of(request.head)
        bs = self.kv.block_size
        slots = 2 if request.needs_aligned_slot else 1
        if head is None:
            request.head = None
            blocks = blocks_for(request.num_computed_tokens + num_new_tokens, bs)
        else:  # the head's full blocks are shared, not allocated
            blocks = blocks_for(head.state_len + num_new_tokens, bs) - head.state_len // bs
        protect = head.holder if head is not None else None
        if not self.heads.make_room(blocks, slots, protect, idle, self.admitted):
            return False
        holder = Holder.request(request.request_id)
        held = self.states.allocate(holder, aligned=request.needs_aligned_slot)
        self.admitted.add(request.request_id)
        request.num_cached_tokens = 0
        request.aligned_len = 0
        if head is None:
            self._open_marks(request, None)
            # A fast-path prompt's first segment (context_len 0) starts from zeros without
            # reading its terminal slot (MambaMixer), so only what is read before it is written
            # is zeroed: the aligned slot (a head keeps it even if no aligned position was
            # reached) and a deterministic request's slots (its verify tiles read them).
            zero = list(held) if request.deterministic else [slot for slot in (held.aligned,) if slot is not None]
            self.pending.zero_slots.extend(zero)
            self.kv.grow(holder, request.num_computed_tokens + num_new_tokens)
            return True
        length = head.state_len
        head_table = self.kv.table(head.holder)
        self.kv.share(holder, head_table[: length // bs])
        if length % bs:
            self.kv.grow(holder, length)
            self.pending.blocks.append((head_table[length // bs], self.kv.table(holder)[-1]))
            self.counters["cow_block_copies"] += 1
        # Terminal state, and (for a request that will publish) the aligned state too.
        head_slots = self.states.slots[head.holder]
        self.pending.slots.extend(zip(head_slots, held))
        if held.aligned is not None and head_slots.aligned is None:  # a checkpoint keeps no aligned
            self.pending.zero_slots.append(held.aligned)  # state: the request's starts at position 0
        self.counters["state_copies"] += 1
        self.kv.grow(holder, length + num_new_tokens)
        request.num_computed_tokens = length
        request.aligned_len = head.aligned_len if held.aligned is not None else 0
        request.num_cached_tokens = length
        request.reused_from = head.source
        if request.deterministic:
            # Tiles restart at the head's canonical aligned state: [aligned_len, L) is recomputed
            # in the tile a miss would use (never written into the blocks shared with the head).
            request.num_computed_tokens = request.num_cached_tokens = head.aligned_len
        self._open_marks(request, head.holder)
        return True

    # -- prefix checkpoints ---------------------------------------------------------------------
    def _open_marks(self, request: Request, protect: Holder | None) -> None:
        """Slots for the request's marks still ahead of it and not held yet: from free slots or
        by evicting other checkpoints, never a conversation's head (a mark is optional)."""
        for mark in request.marks:
            if mark.position <= request.num_computed_tokens or mark.key is None or mark.key in self.heads.index:
                continue
            if not self.heads.room_for_mark(protect):
                return
            self.heads.open_mark(request.request_id, mark)

    def marks_in(self, request: Request, start: int, end: int) -> list[tuple[int, int]]:
        """(position, slot) of the request's marks in (start, end]: a chunk running those tokens
        cuts its prefill there and snapshots the state."""
        cut = []
        for pending in self.heads.marks_of(request.request_id):
            if start < pending.mark.position <= end:
                pending.scheduled = True
                cut.append((pending.mark.position, pending.slot))
        return cut

    def open_marks(self, request_id: str) -> list[CheckpointMark]:
        """The request's marks that will become checkpoints (each has its slot), by position."""
        return [pending.mark for pending in self.heads.marks_of(request_id)]

    def reach_marks(self, request: Request) -> None:
        """The request's state now covers num_computed_tokens: marks up to there become checkpoints
        (reported in its output only if they outlive the budget)."""
        made = []
        for pending in list(self.heads.marks_of(request.request_id)):
            if pending.mark.position > request.num_computed_tokens:
                break
            checkpoint = self.heads.close_mark(pending, self.kv.table(Holder.request(request.request_id)))
            if checkpoint is not None:
                made.append((pending.mark.label, checkpoint))
        self._report_kept(request, made)

    def _report_kept(self, request: Request, made: list[tuple[int, CommittedHead]]) -> None:
        if not made:
            return
        self.heads.enforce_checkpoint_budget()
        kept = [(label, c) for label, c in made if self.heads.holds(c)]
        request.checkpoints_made += [(label, c.state_len) for label, c in kept]
        request.checkpoint_keys += [c.prefix for _, c in kept]

    def _final_prefix(self, request: Request) -> PrefixKey | None:
        """The name of a finished request's state (prompt + generated tokens but the last)."""
        if request.prefix_scope is None or request.num_computed_tokens == 0:
            return None
        covered = request.token_ids[: request.num_computed_tokens]
        return PrefixKey(request.prefix_scope, len(covered), tokens_digest(covered))

    def _keep_checkpoint(self, request: Request, base: CommittedHead | None) -> bool:
        key = self._final_prefix(request)
        if key is None:
            return False
        src = Holder.request(request.request_id)
        self.kv.truncate(src, key.length)
        made = self.heads.keep_checkpoint(src, key.length, key, awaiting_tool=request.awaiting_tool)
        if made is None:
            return False
        if base is not None and base.chain_end:
            base.superseded = True  # the chain goes on from the longer link (never a mark's checkpoint)
        self._report_kept(request, [(request.final_label, made)])
        return True

    def fork_request(self, parent: Request, child: Request) -> PendingCopies | None:
        """The child continues from the parent's state (its whole prompt, just run): the
        parent's full blocks shared, its tail block and terminal Mamba state copied, as when
        attaching a head. The copies are returned, to be made at once (the parent may end and
        free its tail before the next step). None (nothing changed) if there is no room.

        All-or-nothing: room for the tail block and the slot is made first."""
        src = Holder.request(parent.request_id)
        length, bs = parent.num_computed_tokens, self.kv.block_size
        if not self.heads.make_room(1 if length % bs else 0, 1, None, idle=False, admitted=self.admitted):
            return None
        holder = Holder.request(child.request_id)
        held = self.states.allocate(holder, aligned=False)
        self.admitted.add(child.request_id)
        parent_table = self.kv.table(src)
        self.kv.share(holder, parent_table[: length // bs])
        copies = PendingCopies(slots=[(self.states.slots[src].terminal, held.terminal)])
        if length % bs:
            self.kv.grow(holder, length)
            copies.blocks.append((parent_table[length // bs], self.kv.table(holder)[-1]))
            self.counters["cow_block_copies"] += 1
        self.counters["state_copies"] += 1
        child.num_computed_tokens = length
        child.num_cached_tokens = parent.num_cached_tokens
        child.reused_from = parent.reused_from
        return copies

    def can_grow(self, request: Request, num_tokens: int) -> bool:
        """Room for a running request to cover num_tokens, evicting unpinned heads if needed."""
        need = self.kv.blocks_needed(Holder.request(request.request_id), num_tokens)
        return self.heads.make_room(need, 0, None, idle=False, admitted=self.admitted)

    def grow(self, request: Request, num_tokens: int) -> None:
        self.kv.grow(Holder.request(request.request_id), num_tokens)

    def release(self, request: Request) -> None:
        """Free a request's blocks and slots (preemption); its pin on a head stays."""
        self.heads.drop_marks(request.request_id)
        self._free(Holder.request(request.request_id))
        self.admitted.discard(request.request_id)

    def finish(self, request: Request, completed: bool) -> PreparedState | None:
        """What happens to a finished request's state: its own `keep` field decides."""
        base = self.heads.head_of(request.head)  # a detached request no longer pins anything
        self.heads.drop_marks(request.request_id)
        admitted = request.request_id in self.admitted
        if completed and request.keep is KeepState.PREPARE and admitted:
            self.admitted.discard(request.request_id)
            prepared = self.heads.prepare(request, base, time.monotonic(), prefix=self._final_prefix(request))
            request.prepared = prepared
            return prepared
        if completed and request.keep is KeepState.CHECKPOINT and admitted and self._keep_checkpoint(request, base):
            self.admitted.discard(request.request_id)
            self.heads.unpin(base, request.request_id)
            return None
        self.discard(request)
        return None

    def discard(self, request: Request) -> None:
        """Free everything a request holds and drop its pin (it ended without keeping state)."""
        self.release(request)
        self.heads.unpin(self.heads.head_of(request.head), request.request_id)

    def block_table(self, request: Request) -> list[int]:
        return self.kv.table(Holder.request(request.request_id))

    def state_slot(self, request: Request) -> int:
        return self.states.slot_of(Holder.request(request.request_id))

    def aligned_slot(self, request: Request) -> int | None:
        return self.states.slots[Holder.request(request.request_id)].aligned

    # -- heads ----------------------------------------------------------------------------------
    def fork_head(self, source: CommittedHead, key: str, turn: int, version: int) -> CommittedHead:
        """A new head sharing the source's blocks, with its own copies of the Mamba states.

        All-or-nothing: room for the slots is made while the source is protected."""
        need = len(self.states.slots[source.holder])
        if not self.heads.make_room(0, need, source.holder, idle=False, admitted=self.admitted):
            raise OutOfCacheError(f"Mamba state pool: a fork needs {need} slots, {self.states.num_free} free")
        holder = self.heads.new_holder(HolderKind.HEAD)
        src_slots = self.states.slots[source.holder]
        held = self.states.allocate(holder, aligned=src_slots.aligned is not None)
        self.kv.share(holder, self.kv.table(source.holder))
        self._copy_slots_now(list(zip(src_slots, held)))
        head = CommittedHead(
            holder, key, turn, version, source.state_len, source.aligned_len, source.canonical_window
        )
        self.heads.add(head)
        return head

    def install_head(
        self,
        key: str,
        turn: int,
        version: int,
        state_len: int,
        aligned_len: int,
        blocks: list[int | None],
        aligned: bool,
        write: Callable[[list[int], HolderSlots], None],
        canonical_window: int = 0,
    ) -> CommittedHead:
        """A head from an import. `blocks`: per position of the table, a local block to share
        (the receiver already held that chunk) or None (a new block `write` fills).

        All-or-nothing: the shared blocks are referenced first (so evicting their owners cannot
        free them), then room is made, then new blocks and slots are allocated and written; on
        any failure the holder is released and nothing else changed."""
        slots = 2 if aligned else 1

        def room(new: int, holder: Holder) -> bool:
            return self.heads.make_room(new, slots, None, idle=False, admitted=self.admitted)

        holder = self._install(HolderKind.HEAD, blocks, aligned, write, room, "importing a head")
        head = CommittedHead(holder, key, turn, version, state_len, aligned_len, canonical_window)
        self.heads.add(head)
        return head

    def install_checkpoint(
        self, key: PrefixKey, state_len: int, blocks: list[int | None], write: Callable[[list[int], HolderSlots], None],
    ) -> CommittedHead:
        """A prefix checkpoint from an import (another replica computed it), named `key`: its
        terminal state and `blocks` as for install_head, within the checkpoints' budget; room is
        made by evicting other checkpoints only (never a head or a request's state: the import is
        optional, as a mark is). All-or-nothing: OutOfCacheError (nothing changed) if it does not fit."""

        def room(new: int, holder: Holder) -> bool:
            return self.heads.room_for_checkpoint(new, 1, protect=holder)

        holder = self._install(HolderKind.CHECKPOINT, blocks, False, write, room, "importing a prefix checkpoint")
        return self.heads.add_checkpoint(holder, state_len, key)

    def _install(self, kind: HolderKind, blocks: list[int | None], aligned: bool,
                 write: Callable[[list[int], HolderSlots], None], room: Callable[[int, Holder], bool],
                 what: str) -> Holder:
        """A new holder of `kind` with an import's blocks and slots. The shared blocks are
        referenced first (so evicting their owners cannot free them), then `room` is made for the
        new ones, then new blocks and slots are allocated and written; on any failure the holder
        is released and nothing else changed."""
        holder = self.heads.new_holder(kind)
        try:
            shared = [b for b in blocks if b is not None]
            self.kv.share(holder, shared)
            new = len(blocks) - len(shared)
            if not room(new, holder):
                raise OutOfCacheError(f"cache full: {what} needs {new} new blocks")
            fresh = self.kv.fill(holder, blocks)
            held = self.states.allocate(holder, aligned=aligned)
            write(fresh, held)
        except BaseException:
            self._free(holder)
            raise
        return holder

    def remember_chunks(self, head: CommittedHead, digests: list[str]) -> None:
        """Name the head's full KV blocks by their contents' digests (an import knows them)."""
        full = head.state_len // self.kv.block_size
        for digest, block in list(zip(digests, self.kv.table(head.holder)))[:full]:
            self.chunks.remember(block, self.kv.generation(block), digest)

    def _free(self, holder: Holder) -> None:
        for manager in self.managers:
            manager.free(holder)

    def check_integrity(self) -> None:
        for what, manager in zip(("KV blocks", "Mamba state slots"), self.managers):
            manager.usage().check(what)
        self.heads.check()
        marking = set(self.heads.marking) - self.admitted
        assert not marking, f"marks of requests that are not admitted (a leak): {marking}"
        for what, manager in zip(("KV blocks", "Mamba slots"), self.managers):
            stray = {h.id for h in manager.holders() if h.kind is HolderKind.REQUEST} - self.admitted
            assert not stray, f"{what} held by requests that are not admitted: {stray}"
