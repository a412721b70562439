"""One front for both cache groups: what a request needs to run, and attaching heads.

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

    def take(self) -> PendingCopies:
        taken = PendingCopies(self.blocks, self.slots)
        self.blocks, self.slots = [], []
        return taken


class CacheCoordinator:
    def __init__(self, kv: KVCacheManager, states: MambaStateManager):
        self.kv = kv
        self.states = states
        self.pending = PendingCopies()
        self.counters = {"cow_block_copies": 0, "state_copies": 0}

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        holder = Holder.request(request.request_id)
        first = request.num_computed_tokens if request.head is None else request.head.state_len
        return self.states.can_allocate(1) and self.kv.can_allocate(
            self.kv.blocks_needed(holder, first + num_new_tokens)
        )

    def admit(self, request: Request) -> None:
        """Give a waiting request its state slot, continuing its head if it has one."""
        holder = Holder.request(request.request_id)
        slot = self.states.allocate(holder)
        request.num_cached_tokens = 0
        if request.head is None:
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
        self.pending.slots.append((self.states.slot_of(head), slot))
        self.counters["state_copies"] += 1
        request.num_computed_tokens = length
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

    def check_integrity(self) -> None:
        self.kv.usage().check("KV blocks")
        self.states.usage().check("Mamba state slots")
