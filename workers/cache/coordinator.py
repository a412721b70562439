"""One front for both cache groups: what a request needs to run, and attaching heads.

A request that will publish its state (a conversation turn) holds two Mamba slots: the
running state, and a snapshot at the last aligned position it passed (deterministic mode
restarts tiles there).

Attaching a committed head (state covers `L` tokens, block size 4, L = 10):

    head blocks:     [ b3 | b5 | b8: t8 t9 . . ]
    request blocks:  [ b3 | b5 | b9: t8 t9 . . ]   b3, b5 by reference; b8 -> b9 copied (tail COW)
    request slot:    s7 <- copy of the head's terminal slot

If L is block-aligned there is no tail to copy: all blocks are shared and the request's
first new token opens a fresh block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.cache.holders import Holder
from workers.cache.kv_blocks import KVCacheManager
from workers.cache.mamba_slots import MambaStateManager
from workers.request import Request


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
    def __init__(self, kv: KVCacheManager, states: MambaStateManager):
        self.kv = kv
        self.states = states
        self.pending = PendingCopies()
        self.counters = {"cow_block_copies": 0, "state_copies": 0}

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        slots = 2 if request.needs_aligned_slot else 1
        if request.head is None:
            blocks = self.kv.blocks_needed(Holder.request(request.request_id), request.num_computed_tokens + num_new_tokens)
        else:  # the head's full blocks are shared, not allocated
            length = request.head.state_len
            blocks = -(-(length + num_new_tokens) // self.kv.block_size) - length // self.kv.block_size
        return self.states.can_allocate(slots) and self.kv.can_allocate(blocks)

    def admit(self, request: Request) -> None:
        """Give a waiting request its state slot, continuing its head if it has one."""
        holder = Holder.request(request.request_id)
        slots = [self.states.allocate(holder)]
        if request.needs_aligned_slot:
            slots.append(self.states.allocate(holder, high=True))
        request.num_cached_tokens = 0
        request.aligned_len = 0
        if request.head is None:
            self.pending.zero_slots.extend(slots)
            return
        head, length = request.head.holder, request.head.state_len
        bs = self.kv.block_size
        head_table = self.kv.table(head)
        full = length // bs
        self.kv.share(holder, head_table[:full])
        if length % bs:
            self.kv.grow(holder, length)
            self.pending.blocks.append((head_table[full], self.kv.table(holder)[-1]))
            self.counters["cow_block_copies"] += 1
        # Terminal state, and (for a request that will publish) the aligned state too.
        self.pending.slots.extend(zip(self.states.slots[head], slots))
        self.counters["state_copies"] += 1
        request.num_computed_tokens = length
        request.aligned_len = request.head.aligned_len if request.retain_state else 0
        request.num_cached_tokens = length

    def can_grow(self, request: Request, num_tokens: int) -> bool:
        return self.kv.can_allocate(self.kv.blocks_needed(Holder.request(request.request_id), num_tokens))

    def grow(self, request: Request, num_tokens: int) -> None:
        self.kv.grow(Holder.request(request.request_id), num_tokens)

    def free(self, request: Request) -> None:
        holder = Holder.request(request.request_id)
        self.kv.free(holder)
        self.states.free(holder)

    def block_table(self, request: Request) -> list[int]:
        return self.kv.table(Holder.request(request.request_id))

    def state_slot(self, request: Request) -> int:
        return self.states.slot_of(Holder.request(request.request_id))

    def aligned_slot(self, request: Request) -> int | None:
        slots = self.states.slots[Holder.request(request.request_id)]
        return slots[1] if len(slots) > 1 else None

    def check_integrity(self) -> None:
        self.kv.usage().check("KV blocks")
        self.states.usage().check("Mamba state slots")
