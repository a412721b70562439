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
  its chunks that V does not reuse ("superseded"). An entry names the conversation's
  incarnation (Head.incarnation); a newer incarnation replaces it whatever the version.
- A commit is all-or-nothing: chunks are installed, spilled if over budget, and only
  then is the entry switched; if the disk refuses a spill (full, file too large), the
  new chunks are removed again, the failing chunk stays in memory, the old entry stays,
  and the caller gets ResourceExhausted. Since full KV blocks never change,
  an export at V usually reuses most chunks of V-1 and only the new ones travel.
- When memory exceeds the budget, least-recently-used chunks move to disk. Reads from
  disk do not promote back: imports are one-shot (a migration), promoting would only
  churn the budget.
- Every read re-hashes the chunk; a mismatch drops the entry (the head is then
  recovered from the ledger instead) and raises DataLoss.
- The index lives in memory: on start the spill directory is wiped, since files of a
  previous process have no entries pointing at them.
- Beside the conversations' entries: prefix checkpoints, keyed by (scope tag, prefix name),
  their chunks in one namespace per scope, bounded in bytes and by a TTL (prefix_tier.py keeps
  their books). `conversations()` and `entry()` never see them. Entries the tier let go
  (evicted, expired, corrupt) are queued for `take_withdrawn`, so the service can withdraw
  their names from the prefix index.

Thread-safe: the servicer calls it from worker threads so hashing and disk I/O stay
off the event loop (hashlib releases the GIL on large buffers). `_lock` is held during
disk I/O (a commit's spill of tens of MB, unlinks), so the event loop never takes it:
it calls only `version_of` and `entry`, which read the entries without the lock (one
dict lookup; entries are immutable and replaced whole), and every other method from a
thread. Otherwise one spill would stall every RPC of the service, lease renewals too.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cache_service import errors
from cache_service.config import TierConfig
from cache_service.hashing import sha256
from cache_service.prefix_tier import PrefixBook, PrefixEntry, PrefixKey
from cache_service.tier_chunks import ChunkKey, ChunkRef

SPILL_SUBDIR = "tier-v1"


@dataclass(frozen=True)
class Entry:
    incarnation: str
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
    prefix_entries: int = 0
    prefix_bytes: int = 0


@dataclass
class _Store:
    memory: OrderedDict[ChunkKey, bytes] = field(default_factory=OrderedDict)
    disk: dict[ChunkKey, int] = field(default_factory=dict)  # chunk -> size on disk


class StateTier:
    def __init__(self, config: TierConfig, *, prefix_ttl_s: float = 1800.0,
                 clock: Callable[[], float] = time.monotonic):
        self._budget = config.memory_budget_bytes
        self._dir = Path(config.directory) / SPILL_SUBDIR
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir.mkdir(parents=True)
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._store = _Store()
        self._stats = TierStats()
        self._prefixes = PrefixBook(config.prefix_budget_bytes, prefix_ttl_s, clock)
        self._withdrawn: list[PrefixKey] = []

    # -- queries ------------------------------------------------------------------

    def missing(self, conv: str, digests: list[bytes]) -> list[bytes]:
        with self._lock:
            return [d for d in dict.fromkeys(digests) if not self._has(conv, d)]

    def version_of(self, conv: str) -> int:
        """Lock-free (safe on the event loop)."""
        entry = self._entries.get(conv)
        return entry.version if entry else 0

    def entry(self, conv: str, version: int) -> Entry:
        """The entry at `version` (0: whichever the tier holds). Lock-free (safe on the event loop)."""
        entry = self._entries.get(conv)
        if entry is None or (version and entry.version != version):
            held = f"holds version {entry.version}" if entry else "holds nothing"
            raise errors.NotFound(f"state tier has no version {version} of this conversation ({held})")
        return entry

    def conversations(self) -> list[str]:
        """The conversations (hashes) holding an entry."""
        with self._lock:
            return list(self._entries)

    def check_sizes(self, conv: str, chunks: list[ChunkRef]) -> None:
        """InvalidArgument if a chunk the tier holds is declared with another size."""
        with self._lock:
            self._check_sizes(conv, chunks)

    def read_chunk(self, conv: str, entry: Entry | PrefixEntry, ref: ChunkRef) -> bytes:
        """The chunk's bytes, checksum verified (`conv`: the entry's namespace)."""
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
                chunks=len(self._store.memory) + len(self._store.disk),
                prefix_entries=len(self._prefixes), prefix_bytes=self._prefixes.bytes)

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def check_prefix_fits(self, chunks: tuple[ChunkRef, ...] | list[ChunkRef]) -> None:
        """ResourceExhausted if these chunks alone exceed the prefix budget (lock-free: a constant)."""
        size = sum({c.digest: c.size for c in chunks}.values())
        if size > self._prefixes.budget_bytes:
            raise errors.ResourceExhausted(
                f"a prefix state of {size} bytes exceeds the tier's prefix budget of {self._prefixes.budget_bytes}")

    # -- mutations ----------------------------------------------------------------

    def commit(self, conv: str, incarnation: str, version: int, chunks: list[ChunkRef],
               staged: Mapping[bytes, bytes]) -> int:
        """Install `version` from staged chunks plus chunks already held; returns reused count.

        Staged chunks must already be verified against their digests (the servicer
        does it as they arrive). Raises MissingChunks if a digest is nowhere,
        InvalidArgument if a held chunk is declared with another size, ResourceExhausted
        if the disk refused a spill; in every case nothing changed.
        """
        with self._lock:
            old = self._entries.get(conv)
            if old is not None and old.incarnation == incarnation and old.version > version:
                raise errors.VersionConflict(
                    f"state tier already holds newer version {old.version}", current_version=old.version)
            wanted = dict.fromkeys(c.digest for c in chunks)
            superseded = [c.digest for c in old.chunks if c.digest not in wanted] if old else []
            reused = self._install(conv, chunks, staged, leaving=superseded)
            self._entries[conv] = Entry(incarnation, version, tuple(chunks))
            self._drop_chunks(conv, superseded)
            return reused

    def commit_prefix(self, entry: PrefixEntry, staged: Mapping[bytes, bytes]) -> int:
        """Install a prefix checkpoint (replacing one of its name) as `commit` installs a head;
        returns the reused count. Least recently used prefix entries then go until the prefix
        budget holds; ResourceExhausted (nothing changed) if this one alone exceeds it."""
        self.check_prefix_fits(entry.chunks)
        with self._lock:
            self._expire_prefixes()
            reused = self._install(entry.namespace, list(entry.chunks), staged,
                                   leaving=self._prefixes.released_by(entry.key, (c.digest for c in entry.chunks)))
            self._release(self._prefixes.put(entry))
            while (victim := self._prefixes.next_eviction(keep=entry.key)) is not None:
                self._withdraw(victim)
            return reused

    def prefix_entry(self, scope_tag: str, name: str) -> PrefixEntry:
        """The prefix checkpoint, now the most recently used; NotFound if absent or expired."""
        with self._lock:
            self._expire_prefixes()
            entry = self._prefixes.use((scope_tag, name))
        if entry is None:
            raise errors.NotFound("state tier holds no prefix state of this name in this scope "
                                  "(never put, evicted or expired): recompute it")
        return entry

    def expire_prefixes(self) -> int:
        """Drop prefix checkpoints past their TTL; returns how many."""
        with self._lock:
            return self._expire_prefixes()

    def take_withdrawn(self) -> list[PrefixKey]:
        """Prefix checkpoints let go since the last call, and not put again since."""
        with self._lock:
            out = [key for key in dict.fromkeys(self._withdrawn) if key not in self._prefixes]
            self._withdrawn.clear()
            return out

    def drop(self, conv: str) -> bool:
        """Forget the conversation's entry and chunks (conversation deleted)."""
        with self._lock:
            entry = self._entries.pop(conv, None)
            if entry is not None:
                self._drop_chunks(conv, [c.digest for c in entry.chunks])
            return entry is not None

    # -- internals (lock held) ----------------------------------------------------

    def _install(self, ns: str, chunks: list[ChunkRef], staged: Mapping[bytes, bytes], leaving: list[bytes]) -> int:
        """Put the chunks an entry lacks into memory and spill over budget; returns how many the
        namespace already held. `leaving`: chunks that go once the entry is switched; if they are
        still in memory, nothing is spilled for their sake. On any error nothing changed."""
        self._check_sizes(ns, chunks)
        wanted = dict.fromkeys(c.digest for c in chunks)
        absent = [d for d in wanted if d not in staged and not self._has(ns, d)]
        if absent:
            raise errors.MissingChunks(
                f"{len(absent)} chunk(s) are neither in the stream nor in the tier; "
                "resend them", missing=len(absent))
        added = [d for d in wanted if not self._has(ns, d)]
        for digest in added:
            self._store.memory[(ns, digest)] = staged[digest]
            self._stats.memory_bytes += len(staged[digest])
        allowance = sum(len(self._store.memory.get((ns, d), b"")) for d in dict.fromkeys(leaving))
        try:
            self._spill_over_budget(allowance=allowance)
        except OSError as exc:
            self._drop_chunks(ns, added)
            raise errors.ResourceExhausted(
                f"state tier cannot spill to disk ({exc.strerror or exc}); nothing stored") from None
        return len(wanted) - len(added)

    def _expire_prefixes(self) -> int:
        expired = self._prefixes.expired()
        for key in expired:
            self._withdraw(key)
        return len(expired)

    def _withdraw(self, key: PrefixKey, entry: PrefixEntry | None = None) -> None:
        released = self._prefixes.remove(key, entry)
        if released is not None:
            self._withdrawn.append(key)
            self._release(released)

    def _release(self, chunk_keys: list[ChunkKey]) -> None:
        by_ns: dict[str, list[bytes]] = {}
        for ns, digest in chunk_keys:
            by_ns.setdefault(ns, []).append(digest)
        for ns, digests in by_ns.items():
            self._drop_chunks(ns, digests)

    def _check_sizes(self, conv: str, chunks: list[ChunkRef]) -> None:
        for i, ref in enumerate(chunks):
            key = (conv, ref.digest)
            data = self._store.memory.get(key)
            held = len(data) if data is not None else self._store.disk.get(key)
            if held is not None and held != ref.size:
                raise errors.InvalidArgument(
                    f"manifest.chunks[{i}] declares {ref.size} bytes for a chunk the tier holds "
                    f"with {held} bytes")

    def _has(self, conv: str, digest: bytes) -> bool:
        key = (conv, digest)
        return key in self._store.memory or key in self._store.disk

    def _chunk_path(self, key: ChunkKey) -> Path:
        conv, digest = key
        return self._dir / conv / digest.hex()

    def _drop_chunks(self, conv: str, digests: list[bytes]) -> None:
        unlinked = False
        for digest in dict.fromkeys(digests):
            key = (conv, digest)
            data = self._store.memory.pop(key, None)
            if data is not None:
                self._stats.memory_bytes -= len(data)
            size = self._store.disk.pop(key, None)
            if size is not None:
                self._stats.disk_bytes -= size
                self._chunk_path(key).unlink(missing_ok=True)
                unlinked = True
        if unlinked:
            self._remove_dir_if_empty(conv)

    def _remove_dir_if_empty(self, conv: str) -> None:
        try:
            (self._dir / conv).rmdir()
        except OSError:
            pass  # not empty (other chunks of this conversation are on disk) or never made

    def _drop_corrupt(self, conv: str, entry: Entry | PrefixEntry) -> None:
        with self._lock:
            self._stats.checksum_failures += 1
            if isinstance(entry, PrefixEntry):
                self._withdraw(entry.key, entry)
            elif self._entries.get(conv) is entry:
                del self._entries[conv]
                self._drop_chunks(conv, [c.digest for c in entry.chunks])

    def _spill_over_budget(self, allowance: int = 0) -> None:
        """Move least-recently-used chunks to disk until memory fits the budget (plus
        `allowance`). On a disk error the chunk being written stays in memory, its
        temporary file is removed, and the OSError propagates."""
        while self._stats.memory_bytes > self._budget + allowance and self._store.memory:
            key, data = self._store.memory.popitem(last=False)
            path = self._chunk_path(key)
            tmp = path.with_suffix(".tmp")
            try:
                path.parent.mkdir(exist_ok=True)
                tmp.write_bytes(data)
                os.replace(tmp, path)  # a crash mid-write never leaves a half chunk under its name
            except OSError:
                tmp.unlink(missing_ok=True)
                self._store.memory[key] = data
                self._store.memory.move_to_end(key, last=False)
                self._remove_dir_if_empty(key[0])
                raise
            self._store.disk[key] = len(data)
            self._stats.memory_bytes -= len(data)
            self._stats.disk_bytes += len(data)
            self._stats.spills += 1
