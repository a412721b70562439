"""The state tier: exported heads as content-addressed chunks, memory then disk.

An entry is the exported state of one conversation at one head version: an ordered
list of chunk digests (sha256) whose concatenation is the engine's export bytes. The
tier never interprets those bytes.

    conversation c ──> Entry(version=7, chunks=[d0, d1, d2, d1])     (d1 twice: stored once)
                              │
    chunk store  (c,d0) (c,d1) (c,d2)   ── LRU ──>  memory (≤ budget) | disk files

- Chunks are scoped per conversation: dedup never crosses conversations, so asking
  "which digests are missing?" reveals nothing about anyone else's state.
- One entry per conversation: committing version V replaces the older entry and drops
  its chunks that V does not reuse ("superseded"). Since full KV blocks never change,
  an export at V usually reuses most chunks of V-1 and only the new ones travel.
- When memory exceeds the budget, least-recently-used chunks move to disk. Reads from
  disk do not promote back: imports are one-shot (a migration), promoting would only
  churn the budget.
- Every read re-hashes the chunk; a mismatch drops the entry (the head is then
  recovered from the ledger instead) and raises DataLoss.
- The index lives in memory: on start the spill directory is wiped, since files of a
  previous process have no entries pointing at them.

Thread-safe: the servicer calls it from worker threads so hashing and disk I/O stay
off the event loop (hashlib releases the GIL on large buffers).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cache_service import errors
from cache_service.config import TierConfig
from cache_service.hashing import sha256

SPILL_SUBDIR = "tier-v1"
ChunkKey = tuple[str, bytes]  # (conversation hash, sha256 digest)


@dataclass(frozen=True)
class ChunkRef:
    digest: bytes
    size: int


@dataclass(frozen=True)
class Entry:
    version: int
    chunks: tuple[ChunkRef, ...]

    @property
    def total_bytes(self) -> int:
        return sum(c.size for c in self.chunks)


@dataclass
class TierStats:
    memory_bytes: int = 0
    disk_bytes: int = 0
    spills: int = 0
    disk_reads: int = 0
    checksum_failures: int = 0
    entries: int = 0
    chunks: int = 0


@dataclass
class _Store:
    memory: OrderedDict[ChunkKey, bytes] = field(default_factory=OrderedDict)
    disk: dict[ChunkKey, int] = field(default_factory=dict)  # chunk -> size on disk


class StateTier:
    def __init__(self, config: TierConfig):
        self._budget = config.memory_budget_bytes
        self._dir = Path(config.directory) / SPILL_SUBDIR
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir.mkdir(parents=True)
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._store = _Store()
        self._stats = TierStats()

    # -- queries ------------------------------------------------------------------

    def missing(self, conv: str, digests: list[bytes]) -> list[bytes]:
        with self._lock:
            return [d for d in dict.fromkeys(digests) if not self._has(conv, d)]

    def version_of(self, conv: str) -> int:
        with self._lock:
            entry = self._entries.get(conv)
            return entry.version if entry else 0

    def entry(self, conv: str, version: int) -> Entry:
        """The entry at `version` (0: whichever the tier holds)."""
        with self._lock:
            entry = self._entries.get(conv)
        if entry is None or (version and entry.version != version):
            held = f"holds version {entry.version}" if entry else "holds nothing"
            raise errors.NotFound(f"state tier has no version {version} of this conversation ({held})")
        return entry

    def read_chunk(self, conv: str, entry: Entry, ref: ChunkRef) -> bytes:
        """The chunk's bytes, checksum verified."""
        key = (conv, ref.digest)
        with self._lock:
            data = self._store.memory.get(key)
            if data is not None:
                self._store.memory.move_to_end(key)
            elif key not in self._store.disk:
                raise errors.NotFound("state tier entry was superseded or deleted while reading")
        if data is None:
            try:
                data = self._chunk_path(key).read_bytes()
            except FileNotFoundError:
                raise errors.NotFound("state tier entry was superseded or deleted while reading") from None
            with self._lock:
                self._stats.disk_reads += 1
        if len(data) != ref.size or sha256(data) != ref.digest:
            self._drop_corrupt(conv, entry)
            raise errors.DataLoss(f"state tier chunk {ref.digest.hex()[:16]} failed its checksum; "
                                  "entry dropped, recover from the ledger")
        return data

    def read(self, conv: str, version: int) -> Iterator[bytes]:
        entry = self.entry(conv, version)
        for ref in entry.chunks:
            yield self.read_chunk(conv, entry, ref)

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            return TierStats(
                memory_bytes=s.memory_bytes, disk_bytes=s.disk_bytes, spills=s.spills,
                disk_reads=s.disk_reads, checksum_failures=s.checksum_failures,
                entries=len(self._entries),
                chunks=len(self._store.memory) + len(self._store.disk))

    @property
    def budget_bytes(self) -> int:
        return self._budget

    # -- mutations ----------------------------------------------------------------

    def commit(self, conv: str, version: int, chunks: list[ChunkRef],
               staged: Mapping[bytes, bytes]) -> int:
        """Install `version` from staged chunks plus chunks already held; returns reused count.

        Staged chunks must already be verified against their digests (the servicer
        does it as they arrive). Raises MissingChunks if a digest is nowhere.
        """
        with self._lock:
            old = self._entries.get(conv)
            if old is not None and old.version > version:
                raise errors.VersionConflict(
                    f"state tier already holds newer version {old.version}", current_version=old.version)
            wanted = dict.fromkeys(c.digest for c in chunks)
            absent = [d for d in wanted if d not in staged and not self._has(conv, d)]
            if absent:
                raise errors.MissingChunks(
                    f"{len(absent)} chunk(s) are neither in the stream nor in the tier; "
                    "resend them", missing=len(absent))
            reused = 0
            for digest in wanted:
                if self._has(conv, digest):
                    reused += 1
                else:
                    self._store.memory[(conv, digest)] = staged[digest]
                    self._stats.memory_bytes += len(staged[digest])
            self._entries[conv] = Entry(version, tuple(chunks))
            if old is not None:
                self._drop_chunks(conv, [c.digest for c in old.chunks if c.digest not in wanted])
            self._spill_over_budget()
            return reused

    def drop(self, conv: str) -> bool:
        """Forget the conversation's entry and chunks (conversation deleted)."""
        with self._lock:
            entry = self._entries.pop(conv, None)
            if entry is not None:
                self._drop_chunks(conv, [c.digest for c in entry.chunks])
            return entry is not None

    # -- internals (lock held) ----------------------------------------------------

    def _has(self, conv: str, digest: bytes) -> bool:
        key = (conv, digest)
        return key in self._store.memory or key in self._store.disk

    def _chunk_path(self, key: ChunkKey) -> Path:
        conv, digest = key
        return self._dir / conv / digest.hex()

    def _drop_chunks(self, conv: str, digests: list[bytes]) -> None:
        for digest in dict.fromkeys(digests):
            key = (conv, digest)
            data = self._store.memory.pop(key, None)
            if data is not None:
                self._stats.memory_bytes -= len(data)
            size = self._store.disk.pop(key, None)
            if size is not None:
                self._stats.disk_bytes -= size
                self._chunk_path(key).unlink(missing_ok=True)

    def _drop_corrupt(self, conv: str, entry: Entry) -> None:
        with self._lock:
            self._stats.checksum_failures += 1
            if self._entries.get(conv) is entry:
                del self._entries[conv]
                self._drop_chunks(conv, [c.digest for c in entry.chunks])

    def _spill_over_budget(self) -> None:
        while self._stats.memory_bytes > self._budget and self._store.memory:
            key, data = self._store.memory.popitem(last=False)
            path = self._chunk_path(key)
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)  # a crash mid-write never leaves a half chunk under its name
            self._store.disk[key] = len(data)
            self._stats.memory_bytes -= len(data)
            self._stats.disk_bytes += len(data)
            self._stats.spills += 1
