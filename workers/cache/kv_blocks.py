"""Paged attention KV: a reference-counted block pool and per-holder block tables.

A block may be shared by several holders (a committed head and the turns that continue
it); it is written only while exactly one holder owns it, and returns to the free list
when its last reference goes.

    head H:     [b3, b5, b8*]          * = tail block, partly filled (committed len 10, bs 4)
    request R:  [b3, b5, b9]  + new    b3, b5 shared by reference; b8 copied into b9 (COW)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from workers.cache.holders import CacheUsage, Holder, HolderKind
from workers.cache.layout import NULL_BLOCK, KVCacheLayout
from workers.errors import OutOfCacheError


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.ref_counts[NULL_BLOCK] = 1  # never handed out
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfCacheError(f"KV cache: need {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            assert b != NULL_BLOCK and self.ref_counts[b] > 0, f"decref of free block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


class KVCacheManager:
    """Block tables per holder over one `BlockPool`.

    `reclaim(n)` is called when fewer than n blocks are free; the conversation cache plugs
    its LRU eviction of committed heads in there.
    """

    def __init__(self, layout: KVCacheLayout):
        self.layout = layout
        self.block_size = layout.block_size
        self.pool = BlockPool(layout.num_blocks)
        self.tables: dict[Holder, list[int]] = {}
        self.reclaim: Callable[[int], None] = lambda n: None

    def table(self, holder: Holder) -> list[int]:
        return self.tables.get(holder, [])

    def blocks_needed(self, holder: Holder, num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.table(holder)))

    def can_allocate(self, n_blocks: int) -> bool:
        if n_blocks > self.pool.num_free:
            self.reclaim(n_blocks)
        return n_blocks <= self.pool.num_free

    def grow(self, holder: Holder, num_tokens: int) -> None:
        """Make the holder's table cover positions [0, num_tokens)."""
        n = self.blocks_needed(holder, num_tokens)
        if n and not self.can_allocate(n):
            raise OutOfCacheError(f"KV cache: need {n} blocks, {self.pool.num_free} free")
        self.tables.setdefault(holder, []).extend(self.pool.allocate(n))

    def append_new(self, holder: Holder, n: int) -> list[int]:
        """Append n fresh blocks to the holder's table (importing state written elsewhere)."""
        if n and not self.can_allocate(n):
            raise OutOfCacheError(f"KV cache: need {n} blocks, {self.pool.num_free} free")
        blocks = self.pool.allocate(n)
        self.tables.setdefault(holder, []).extend(blocks)
        return blocks

    def share(self, holder: Holder, blocks: list[int]) -> None:
        """Append already-written blocks to the holder's table by reference."""
        self.pool.incref(blocks)
        self.tables.setdefault(holder, []).extend(blocks)

    def truncate(self, holder: Holder, num_tokens: int) -> None:
        """Drop the blocks past position num_tokens (rollback, or a head keeping a prefix)."""
        table = self.tables.get(holder, [])
        keep = blocks_for(num_tokens, self.block_size)
        self.pool.decref(table[keep:])
        del table[keep:]

    def transfer(self, src: Holder, dst: Holder) -> None:
        """Hand src's table to dst (publishing a request's blocks as the new head)."""
        assert dst not in self.tables, f"{dst} already holds blocks"
        self.tables[dst] = self.tables.pop(src, [])

    def free(self, holder: Holder) -> None:
        self.pool.decref(self.tables.pop(holder, []))

    def usage(self) -> CacheUsage:
        by_request: set[int] = set()
        by_head: set[int] = set()
        for holder, table in self.tables.items():
            (by_request if holder.kind is HolderKind.REQUEST else by_head).update(table)
        # Every reference is one table entry (a table never lists a block twice).
        refs = sum(len(t) for t in self.tables.values())
        assert refs == sum(self.pool.ref_counts) - 1, "block reference counts disagree with the tables"
        usable = self.layout.usable_blocks
        return CacheUsage(
            free=self.pool.num_free, cached=len(by_head - by_request), in_use=len(by_request), total=usable
        )
