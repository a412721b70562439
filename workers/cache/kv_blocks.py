"""Paged attention KV: a reference-counted block pool and per-holder block tables.

A block may be shared by several holders (a committed head and the turns that continue
it); it is written only while exactly one holder owns it, and returns to the free list
when its last reference goes.

    head H:     [b3, b5, b8*]          * = tail block, partly filled (committed len 10, bs 4)
    request R:  [b3, b5, b9]  + new    b3, b5 shared by reference; b8 copied into b9 (COW)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from workers.cache.holders import CacheUsage
from workers.state_names import Holder
from workers.cache.layout import NULL_BLOCK, KVCacheLayout
from workers.cache.manager import CacheManager
from workers.errors import OutOfCacheError


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.ref_counts[NULL_BLOCK] = 1  # never handed out
        # Bumped on every allocation: (block, generation) names one lifetime of a block, so a
        # digest remembered for it is valid exactly while that lifetime lasts.
        self.generation = [0] * num_blocks
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
            self.generation[b] += 1
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


class KVCacheManager(CacheManager):
    """Block tables per holder over one `BlockPool`. Allocation never evicts: the coordinator
    makes room first (all-or-nothing), then allocates."""

    def __init__(self, layout: KVCacheLayout):
        self.layout = layout
        self.block_size = layout.block_size
        self.pool = BlockPool(layout.num_blocks)
        self.tables: dict[Holder, list[int]] = {}

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def holders(self) -> Iterable[Holder]:
        return self.tables.keys()

    def table(self, holder: Holder) -> list[int]:
        return self.tables.get(holder, [])

    def generation(self, block: int) -> int:
        """The block's current lifetime (see `BlockPool.generation`)."""
        return self.pool.generation[block]

    def blocks_needed(self, holder: Holder, num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.table(holder)))

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= self.pool.num_free

    def grow(self, holder: Holder, num_tokens: int) -> None:
        """Make the holder's table cover positions [0, num_tokens)."""
        self.tables.setdefault(holder, []).extend(self.pool.allocate(self.blocks_needed(holder, num_tokens)))

    def append_new(self, holder: Holder, n: int) -> list[int]:
        """Append n fresh blocks to the holder's table (importing state written elsewhere)."""
        blocks = self.pool.allocate(n)
        self.tables.setdefault(holder, []).extend(blocks)
        return blocks

    def fill(self, holder: Holder, blocks: list[int | None]) -> list[int]:
        """Make the holder's table `blocks`, each None a fresh block; the holder already
        references the others (`share`, in order). Returns the fresh blocks in table order."""
        fresh = iter(self.pool.allocate(blocks.count(None)))
        table = [b if b is not None else next(fresh) for b in blocks]
        self.tables[holder] = table
        return [table[i] for i, b in enumerate(blocks) if b is None]

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
            (by_head if holder.kind.cached else by_request).update(table)
        # Every reference is one table entry (a table never lists a block twice).
        refs = sum(len(t) for t in self.tables.values())
        assert refs == sum(self.pool.ref_counts) - 1, "block reference counts disagree with the tables"
        usable = self.layout.usable_blocks
        return CacheUsage(
            free=self.pool.num_free, cached=len(by_head - by_request), in_use=len(by_request), total=usable
        )
