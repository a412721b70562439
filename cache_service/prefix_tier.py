"""The state tier's prefix checkpoints: which exist, in what order they were used, which chunks
they hold. Bookkeeping only: the bytes live in the tier's chunk store (tier.py), whose lock the
caller holds for every call here.

A prefix checkpoint is the engine state of a token prefix no conversation owns (a shared system
prompt, the end of a stateless request), named as the prefix index names it: (scope tag, name).

    scope s ──> (s, n1) = [d0, d1, d2]         chunk namespace "p-s": d0 d1 d2 d3, each once
            ──> (s, n2) = [d0, d1, d3]         refs: d0:2 d1:2 d2:1 d3:1
    scope t ──> (t, n1) = [d0]                 namespace "p-t": d0 again (never shared with s)

- Chunks are shared within a scope and never across scopes (one namespace per scope), so asking
  which digests are missing reveals nothing about another scope. A chunk is counted once per
  entry that uses it and dropped when the last such entry goes.
- Bounded: `bytes` (each chunk of the namespaces counted once) stays within the budget; the least
  recently used entries (by put or read) go first. Entries expire `ttl_s` after their last put
  or read. Both orders are the same: every use moves an entry to the end and sets its expiry to
  now + ttl, so the expired ones are always at the front.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cache_service.tier_chunks import ChunkKey, ChunkRef

PrefixKey = tuple[str, str]  # (scope tag, prefix name)


def namespace(scope_tag: str) -> str:
    """The chunk namespace of a scope's prefix entries. Conversation hashes are 32 hex digits,
    so "p-..." never names a conversation's chunks."""
    return f"p-{scope_tag}"


@dataclass(frozen=True)
class PrefixEntry:
    key: PrefixKey
    tokens: int
    chunks: tuple[ChunkRef, ...]

    @property
    def namespace(self) -> str:
        return namespace(self.key[0])

    @property
    def total_bytes(self) -> int:
        return sum(c.size for c in self.chunks)

    def chunk_keys(self) -> list[ChunkKey]:
        return [(self.namespace, d) for d in dict.fromkeys(c.digest for c in self.chunks)]


class PrefixBook:
    def __init__(self, budget_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[PrefixKey, PrefixEntry] = OrderedDict()  # least recently used first
        self._expires: dict[PrefixKey, float] = {}
        self._refs: dict[ChunkKey, int] = {}
        self._sizes: dict[ChunkKey, int] = {}
        self.bytes = 0  # of the chunks referenced, each once

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: PrefixKey) -> bool:
        return key in self._entries

    def use(self, key: PrefixKey) -> PrefixEntry | None:
        """The entry, now the most recently used (its expiry pushed back); None if absent."""
        entry = self._entries.get(key)
        if entry is not None:
            self._touch(key)
        return entry

    def put(self, entry: PrefixEntry) -> list[ChunkKey]:
        """Install (or replace) the entry; returns the chunks no entry uses any more."""
        for ck, ref in zip(entry.chunk_keys(), _unique(entry.chunks)):
            self._refs[ck] = self._refs.get(ck, 0) + 1
            if ck not in self._sizes:
                self._sizes[ck] = ref.size
                self.bytes += ref.size
        released = self.remove(entry.key) or []  # after the increments: chunks it shares stay
        self._entries[entry.key] = entry
        self._touch(entry.key)
        return released

    def released_by(self, key: PrefixKey, kept: Iterable[bytes]) -> list[bytes]:
        """Digests that replacing `key` by an entry of `kept` digests would free."""
        old = self._entries.get(key)
        if old is None:
            return []
        kept = set(kept)
        return [d for ns, d in old.chunk_keys() if d not in kept and self._refs[(ns, d)] == 1]

    def remove(self, key: PrefixKey, entry: PrefixEntry | None = None) -> list[ChunkKey] | None:
        """Forget the entry (only if it is still `entry`, when given); returns the chunks no
        entry uses any more, None if there was no such entry."""
        held = self._entries.get(key)
        if held is None or (entry is not None and held is not entry):
            return None
        del self._entries[key], self._expires[key]
        released = []
        for ck in held.chunk_keys():
            self._refs[ck] -= 1
            if not self._refs[ck]:
                del self._refs[ck]
                self.bytes -= self._sizes.pop(ck)
                released.append(ck)
        return released

    def expired(self) -> list[PrefixKey]:
        now = self._clock()
        out = []
        for key in self._entries:  # by expiry, soonest first
            if self._expires[key] > now:
                break
            out.append(key)
        return out

    def next_eviction(self, keep: PrefixKey) -> PrefixKey | None:
        """While over the budget, the least recently used entry other than `keep`; else None."""
        if self.bytes <= self.budget_bytes:
            return None
        return next((key for key in self._entries if key != keep), None)

    def _touch(self, key: PrefixKey) -> None:
        self._entries.move_to_end(key)
        self._expires[key] = self._clock() + self.ttl_s


def _unique(chunks: Iterable[ChunkRef]) -> list[ChunkRef]:
    return list({c.digest: c for c in chunks}.values())
