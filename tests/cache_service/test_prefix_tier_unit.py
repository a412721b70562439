"""The tier's prefix checkpoints on their own: chunks shared within a scope and counted, never
across scopes; the byte bound evicts the least recently used; the TTL runs from the last use."""

import pytest

from cache_service.config import TierConfig
from cache_service.errors import MissingChunks, NotFound, ResourceExhausted
from cache_service.hashing import sha256
from cache_service.prefix_tier import PrefixEntry, namespace
from cache_service.tier import ChunkRef, StateTier

S, T = "0123456789abcdef", "fedcba9876543210"  # two scope tags
INC = "0123456789abcdef"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(scope, name, chunks, tokens=10):
    return PrefixEntry((scope, name), tokens, tuple(ChunkRef(sha256(c), len(c)) for c in chunks))


def staged(*chunks):
    return {sha256(c): c for c in chunks}


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def tier(tmp_path, clock):
    return StateTier(TierConfig(directory=tmp_path, memory_budget_bytes=1 << 20, prefix_bytes=3000),
                     prefix_ttl_s=60.0, clock=clock)


def read(tier, scope, name):
    e = tier.prefix_entry(scope, name)
    return b"".join(tier.read_chunk(e.namespace, e, ref) for ref in e.chunks)


def test_a_scope_stores_a_shared_chunk_once_and_keeps_it_while_an_entry_uses_it(tier, clock):
    shared, a, b = b"s" * 500, b"a" * 100, b"b" * 100
    assert tier.commit_prefix(entry(S, "n1", [shared, a]), staged(shared, a)) == 0
    assert tier.missing(namespace(S), [sha256(shared), sha256(b)]) == [sha256(b)]
    clock.now += 30
    assert tier.commit_prefix(entry(S, "n2", [shared, b]), staged(b)) == 1  # `shared` not resent
    assert (tier.stats().prefix_entries, tier.stats().prefix_bytes, tier.stats().chunks) == (2, 700, 3)
    clock.now += 40
    assert tier.expire_prefixes() == 1  # n1 goes, n2 still uses `shared`
    assert read(tier, S, "n2") == shared + b
    assert tier.stats().prefix_bytes == 600 and tier.missing(namespace(S), [sha256(a)]) == [sha256(a)]
    assert tier.take_withdrawn() == [(S, "n1")]


def test_another_scope_shares_nothing(tier):
    secret = b"system prompt state"
    tier.commit_prefix(entry(S, "n1", [secret]), staged(secret))
    assert tier.missing(namespace(T), [sha256(secret)]) == [sha256(secret)]
    with pytest.raises(MissingChunks):  # T cannot borrow S's chunk by naming its digest
        tier.commit_prefix(entry(T, "n1", [secret]), {})
    with pytest.raises(NotFound):
        tier.prefix_entry(T, "n1")


def test_a_put_replaces_its_name_and_drops_chunks_only_it_used(tier):
    old, keep, new = b"o" * 100, b"k" * 100, b"n" * 100
    tier.commit_prefix(entry(S, "n1", [old, keep], tokens=5), staged(old, keep))
    assert tier.commit_prefix(entry(S, "n1", [keep, new], tokens=9), staged(new)) == 1
    assert read(tier, S, "n1") == keep + new and tier.prefix_entry(S, "n1").tokens == 9
    assert tier.missing(namespace(S), [sha256(old)]) == [sha256(old)]
    assert tier.stats().prefix_bytes == 200 and tier.take_withdrawn() == []  # replaced, not withdrawn


def test_the_byte_bound_evicts_the_least_recently_used(tier):
    blobs = {n: bytes([i]) * 1000 for i, n in enumerate(["n1", "n2", "n3", "n4"])}
    for n in ("n1", "n2", "n3"):
        tier.commit_prefix(entry(S, n, [blobs[n]]), staged(blobs[n]))
    tier.prefix_entry(S, "n1")  # read: n2 is now the least recently used
    tier.commit_prefix(entry(S, "n4", [blobs["n4"]]), staged(blobs["n4"]))
    with pytest.raises(NotFound):
        tier.prefix_entry(S, "n2")
    assert [read(tier, S, n) for n in ("n1", "n3", "n4")] == [blobs["n1"], blobs["n3"], blobs["n4"]]
    assert tier.stats().prefix_bytes == 3000 and tier.take_withdrawn() == [(S, "n2")]
    with pytest.raises(ResourceExhausted):  # alone over the bound: refused, nothing evicted
        tier.commit_prefix(entry(S, "big", [b"x" * 3001]), staged(b"x" * 3001))
    assert tier.stats().prefix_entries == 3


def test_entries_expire_a_ttl_after_their_last_put_or_read(tier, clock):
    tier.commit_prefix(entry(S, "n1", [b"one"]), staged(b"one"))
    tier.commit_prefix(entry(S, "n2", [b"two"]), staged(b"two"))
    clock.now += 50
    tier.prefix_entry(S, "n1")  # n1's TTL starts over
    clock.now += 20  # n2 is 70 s old, n1 was read 20 s ago
    assert tier.expire_prefixes() == 1 and tier.take_withdrawn() == [(S, "n2")]
    assert read(tier, S, "n1") == b"one"
    clock.now += 60
    with pytest.raises(NotFound):
        tier.prefix_entry(S, "n1")
    assert tier.stats().prefix_entries == 0 and tier.stats().chunks == 0
    assert tier.take_withdrawn() == [(S, "n1")]


def test_conversations_never_see_prefix_entries(tier):
    tier.commit("c" * 32, INC, 1, [ChunkRef(sha256(b"head"), 4)], staged(b"head"))
    tier.commit_prefix(entry(S, "n1", [b"head"]), staged(b"head"))
    assert tier.conversations() == ["c" * 32]
    assert tier.stats().entries == 1 and tier.stats().prefix_entries == 1
    assert tier.drop("c" * 32)
    assert read(tier, S, "n1") == b"head"  # same bytes, its own copy
