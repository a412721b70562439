"""Which content-addressed chunks this engine holds: digest <-> (block, generation).

A full KV block never changes while it is allocated, so its digest, once computed (off the
engine thread, at the first export) or learnt (at an import), names it for the rest of that
allocation. The pool's per-block generation tells whether a remembered block is still the
same allocation: entries go stale by themselves, nothing has to hook the frees.
"""

from __future__ import annotations

from workers.cache.kv_blocks import BlockPool


class ChunkIndex:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._by_digest: dict[str, tuple[int, int]] = {}
        self._by_block: dict[tuple[int, int], str] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def _live(self, block: int, generation: int) -> bool:
        return self.pool.generation[block] == generation and self.pool.ref_counts[block] > 0

    def remember(self, block: int, generation: int, digest: str) -> None:
        if self._live(block, generation):
            self._by_digest[digest] = (block, generation)
            self._by_block[(block, generation)] = digest
            # At most one live entry per block: past twice that, stale ones dominate. Pruning
            # then keeps the index bounded at an amortized O(1) per remembered block.
            if len(self._by_block) > 2 * self.pool.num_blocks:
                self._prune()

    def digest_of(self, block: int) -> str | None:
        """The remembered digest of the block's current allocation, if any."""
        return self._by_block.get((block, self.pool.generation[block]))

    def block_of(self, digest: str) -> int | None:
        entry = self._by_digest.get(digest)
        if entry is None or not self._live(*entry):
            return None
        return entry[0]

    def held_digests(self) -> set[str]:
        self._prune()
        return set(self._by_digest)

    def _prune(self) -> None:
        for digest, entry in list(self._by_digest.items()):
            if not self._live(*entry):
                del self._by_digest[digest]
                self._by_block.pop(entry, None)
        for entry in [e for e in self._by_block if not self._live(*e)]:
            del self._by_block[entry]
