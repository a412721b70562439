"""StateTier on its own: LRU spill order, dedup within an entry, per-conversation scope."""

import pytest

from cache_service.config import TierConfig
from cache_service.errors import MissingChunks, NotFound
from cache_service.hashing import sha256
from cache_service.tier import ChunkRef, StateTier


INC = "0123456789abcdef"  # the conversation's incarnation (Head.incarnation)


def refs(chunks):
    return [ChunkRef(sha256(c), len(c)) for c in chunks], {sha256(c): c for c in chunks}


@pytest.fixture
def tier(tmp_path):
    return StateTier(TierConfig(directory=tmp_path, memory_budget_bytes=2048))


def test_least_recently_used_chunks_spill_first_and_read_back(tier):
    convs = {name: [bytes([i]) * 1000] for i, name in enumerate("abc")}
    for name, chunks in convs.items():
        tier.commit(name, INC, 1, *refs(chunks))
        if name == "b":
            # Touch a: it becomes more recent than b, so b spills when c arrives.
            entry = tier.entry("a", 1)
            tier.read_chunk("a", entry, entry.chunks[0])
    stats = tier.stats()
    assert (stats.memory_bytes, stats.disk_bytes, stats.spills) == (2000, 1000, 1)
    assert (tier._dir / "b").is_dir() and not (tier._dir / "a").exists()
    for name, chunks in convs.items():
        assert b"".join(tier.read(name, 0)) == chunks[0]


def test_repeated_chunk_is_stored_once_and_missing_ones_are_refused(tier):
    zero, tail = b"\0" * 500, b"tail"
    chunk_refs, staged = refs([zero, zero, tail])
    tier.commit("a", INC, 1, chunk_refs, staged)
    assert tier.stats().chunks == 2 and tier.stats().memory_bytes == 504
    assert b"".join(tier.read("a", 1)) == zero + zero + tail
    with pytest.raises(MissingChunks):
        tier.commit("a", INC, 2, *refs([b"new"])[:1], {})
    assert tier.version_of("a") == 1


def test_chunks_are_scoped_to_their_conversation(tier):
    chunk_refs, staged = refs([b"secret state"])
    tier.commit("a", INC, 1, chunk_refs, staged)
    assert tier.missing("a", [chunk_refs[0].digest]) == []
    assert tier.missing("b", [chunk_refs[0].digest]) == [chunk_refs[0].digest]
    with pytest.raises(MissingChunks):  # b cannot borrow a's chunk by naming its digest
        tier.commit("b", INC, 1, chunk_refs, {})
    with pytest.raises(NotFound):
        tier.entry("b", 0)
