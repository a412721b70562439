"""The vLLM backend's index of prefix checkpoints (no vLLM needed: the host's side is in
test_vllm_session.py)."""

from __future__ import annotations

from workers.vllm_backend.prefixes import PrefixCheckpoint, PrefixCheckpoints


def checkpoint(head_id: str, tokens: tuple[int, ...], salt: str = "s", nbytes: int = 40) -> PrefixCheckpoint:
    return PrefixCheckpoint(head_id, salt, tokens, nbytes)


def test_the_longest_proper_prefix_of_the_salt_is_found():
    index = PrefixCheckpoints(1000)
    for c in (checkpoint("short", (1, 2)), checkpoint("long", (1, 2, 3, 4)), checkpoint("other", (1, 2, 3),
                                                                                           salt="t")):
        assert index.keep(c) == []
    assert index.longest("s", [1, 2, 3, 4, 5]).head_id == "long"
    assert index.longest("s", [1, 2, 3, 4]).head_id == "short"  # a prompt's whole length is never loaded
    assert index.longest("s", [1, 2, 9, 4, 5]).head_id == "short"
    assert index.longest("s", [2, 1, 3]) is None
    assert index.longest("u", [1, 2, 3, 4, 5]) is None  # another salt shares nothing
    pins = [c.loads for c in index]
    # what longest loads, and whether it is a request's end (none here: all kept as boundaries),
    assert index.reach("s", [1, 2, 3, 4, 5]) == (4, False) and index.reach("s", [1, 2, 3, 4]) == (2, False)
    assert index.reach("u", [1, 2]) == (0, False)
    assert [c.loads for c in index] == pins  # but pinning nothing


def test_the_budget_drops_the_least_recently_used_but_never_one_being_loaded():
    index = PrefixCheckpoints(100)
    index.keep(checkpoint("a", (1,)))
    index.keep(checkpoint("b", (2,)))
    loading = index.longest("s", [1, 5])  # "a": pinned, and now the most recently used
    assert loading.head_id == "a"
    assert index.keep(checkpoint("c", (3,))) == ["b"]
    assert index.keep(checkpoint("d", (4,))) == ["c"]  # "a" is pinned: the next least recently used goes
    index.release(loading)
    assert index.keep(checkpoint("e", (5,))) == ["a"]
    assert index.nbytes <= index.budget_bytes


def test_a_checkpoint_of_the_same_tokens_replaces_the_older_and_one_too_big_is_not_kept():
    index = PrefixCheckpoints(100)
    index.keep(checkpoint("first", (1, 2)))
    assert index.keep(checkpoint("again", (1, 2))) == ["first"]
    assert len(index) == 1
    assert index.keep(checkpoint("huge", (7, 8), nbytes=500)) == ["huge"]  # the caller drops it in the host
    assert index.longest("s", [1, 2, 3]).head_id == "again"


LAYOUT = {"block_size": 128,
          "attention": [{"name": f"a{i}", "shape": [2, 128, 2, 32], "dtype": "torch.float32"} for i in range(2)],
          "mamba": [{"name": "m0", "shape": [1000], "dtype": "torch.bfloat16"}]}


def test_a_state_is_sized_from_the_layout_and_one_beyond_the_budget_is_not_kept():
    from workers.vllm_backend.prefixes import HostPrefixes, state_bytes

    block = 2 * 128 * 2 * 32 * 4
    assert state_bytes(LAYOUT, 1) == 2 * block + 2000
    assert state_bytes(LAYOUT, 129) == 4 * block + 2000  # a started block is a whole one
    prefixes = HostPrefixes(host=None, budget_bytes=state_bytes(LAYOUT, 256))
    assert not prefixes.fits(10)  # the layout is not known before the host is up
    prefixes.layout = LAYOUT
    assert prefixes.fits(256) and not prefixes.fits(257)
    assert not HostPrefixes(host=None, budget_bytes=0).fits(1)


def test_checkpoints_are_named_as_our_engine_names_them_and_found_by_that_name():
    from proto.contract import tokens_digest
    from workers.state_names import PrefixKey

    index = PrefixCheckpoints(1000)
    index.keep(checkpoint("a", (1, 2, 3)))
    index.keep(checkpoint("b", (1, 2, 3), salt="t"))
    key = PrefixKey("s", 3, tokens_digest((1, 2, 3)))
    found = index.pinned(key)
    assert found.head_id == "a" and found.key == key and found.loads == 1  # pinned: the budget keeps it
    index.release(found)
    assert index.pinned(PrefixKey("u", 3, key.digest)) is None  # another salt's name finds nothing
    assert index.pinned(PrefixKey("s", 2, tokens_digest((1, 2)))) is None


def test_the_names_of_dropped_checkpoints_are_withdrawn_once_but_not_replaced_ones():
    index = PrefixCheckpoints(100)
    index.keep(checkpoint("a", (1,)))
    index.keep(checkpoint("a2", (1,)))  # the same tokens again: the name is still held
    assert index.withdrawn() == []
    index.keep(checkpoint("b", (2,)))
    index.keep(checkpoint("c", (3,)))  # over the budget: (1,) goes
    assert [k.length for k in index.withdrawn()] == [1]
    assert index.withdrawn() == []  # each reported once
    assert index.keep(checkpoint("huge", (7,), nbytes=500)) == ["huge"]  # never held: nothing to withdraw
    assert index.withdrawn() == []
