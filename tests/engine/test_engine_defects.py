"""Regression tests of engine defects found in review (each fails on the code before its fix).

- unseeded requests drew their seed from Python's global `random`: a `random.seed()` anywhere
  made them repeat; the seed must come from the OS and be reported in the output;
- the detokenizer dropped a trailing incomplete character when the request finished;
- a request that keeps its state with nobody to resolve it leaked it forever.
(Dtypes: `test_dtypes.py`.)
"""

from __future__ import annotations

import random
import time

import pytest

from tests.engine.conftest import assert_all_free, new_engine, prompt_of
from workers.cache.chunk_index import ChunkIndex
from workers.cache.kv_blocks import BlockPool
from workers.checkpoint import Arch
from workers.detokenizer import Detokenizer
from workers.errors import HeadExistsError
from workers.request import KeepState
from workers.sampling import SamplingParams


def test_unseeded_requests_do_not_repeat_after_random_seed():
    random.seed(1234)
    first = SamplingParams(temperature=1.0).resolved_seed
    random.seed(1234)
    second = SamplingParams(temperature=1.0).resolved_seed
    assert first != second


def test_outputs_report_the_resolved_seed(tiny):
    engine = new_engine(tiny[Arch.BAMBA].path)
    random.seed(99)
    engine.add_request("a", prompt_of(7, seed=1), SamplingParams(max_tokens=3))
    random.seed(99)
    engine.add_request("b", prompt_of(7, seed=1), SamplingParams(max_tokens=3))
    engine.add_request("seeded", prompt_of(7, seed=1), SamplingParams(max_tokens=3, seed=5))
    seeds = {}
    while engine.has_unfinished():
        for out in engine.step():
            seeds.setdefault(out.request_id, set()).add(out.seed)
    assert all(len(s) == 1 for s in seeds.values()), seeds
    assert seeds["seeded"] == {5}
    assert seeds["a"] != seeds["b"]


class ByteTokenizer:
    """A byte-level tokenizer (ids are UTF-8 bytes): characters may span several tokens."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_emits_a_trailing_incomplete_character_at_finish():
    text = "añ€"
    ids = list(text.encode())[:-1]  # the last character cut inside its UTF-8 sequence
    tok = ByteTokenizer()
    detok = Detokenizer(tok, stop=())
    deltas = [detok.update(token)[0] for token in ids]
    assert "".join(deltas) == "añ", "an incomplete character is held back while running"
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids), "the deltas add up to the text at the finish"


def test_detokenizer_completes_a_character_split_over_tokens():
    ids = list("é!".encode())
    detok = Detokenizer(ByteTokenizer(), stop=())
    deltas = [detok.update(token)[0] for token in ids] + [detok.flush()]
    assert deltas[0] == "" and "".join(deltas) == "é!"


def test_kept_state_nobody_resolves_is_released_after_the_timeout(tiny):
    engine = new_engine(tiny[Arch.BAMBA].path)
    request = engine.add_request("kept", prompt_of(9, seed=2), SamplingParams(max_tokens=2), keep=KeepState.PREPARE)
    while engine.has_unfinished():
        engine.step()
    assert request.prepared is not None and engine.caches.kv.usage().in_use > 0
    timeout = engine.config.cache.prepared_turn_timeout_s
    assert engine.caches.heads.expire(time.monotonic() + timeout + 1) == [request.prepared]
    assert engine.caches.heads.counters["prepared_expired"] == 1
    assert_all_free(engine)


def test_a_raising_expiry_callback_affects_only_its_own_turn(tiny):
    """An owner's on_expire that raises used to escape expire_prepared: the async loop calls it
    outside any handler (the engine thread died) and the other expired states stayed held."""
    engine = new_engine(tiny[Arch.BAMBA].path)

    def boom(state):
        raise RuntimeError("owner callback failed")

    kept = [
        engine.add_request(rid, prompt_of(9, seed=3), SamplingParams(max_tokens=2), keep=KeepState.PREPARE)
        for rid in ("first", "second")
    ]
    while engine.has_unfinished():
        engine.step()
    seen = []
    kept[0].prepared.on_expire = boom
    kept[1].prepared.on_expire = seen.append
    for state in engine.caches.heads.prepared.values():
        state.deadline = 0.0  # due now
    assert engine.expire_prepared() == 2
    assert seen == [kept[1].prepared] and engine.caches.heads.counters["prepared_expired"] == 2
    assert_all_free(engine)


def test_a_commit_onto_a_taken_turn_moves_nothing(tiny):
    """HeadManager.commit used to move the state to a new head holder before finding that
    (conversation, turn) already had a head: the refusal left blocks and slots nobody knew."""
    engine = new_engine(tiny[Arch.BAMBA].path)
    kept = [
        engine.add_request(rid, prompt_of(9, seed=4), SamplingParams(max_tokens=2), keep=KeepState.PREPARE)
        for rid in ("one", "two")
    ]
    while engine.has_unfinished():
        engine.step()
    heads = engine.caches.heads
    heads.commit(kept[0].prepared, "k", 1, 1)
    with pytest.raises(HeadExistsError, match="already has a head"):
        heads.commit(kept[1].prepared, "k", 1, 1)
    assert kept[1].prepared.holder in heads.prepared, "the refused state is still the prepared turn's"
    engine.check_integrity()
    heads.release(kept[1].prepared)
    heads.drop(heads.find("k", 1))
    assert_all_free(engine)


def test_the_chunk_index_forgets_blocks_that_were_freed():
    """Digests remembered at every export used to stay for freed blocks until someone asked
    for the held set: a worker exporting every turn grew the index without bound."""
    pool = BlockPool(num_blocks=5)
    index = ChunkIndex(pool)
    for round_ in range(200):
        blocks = pool.allocate(3)
        for b in blocks:
            index.remember(b, pool.generation[b], f"digest-{round_}-{b}")
        pool.decref(blocks)
    assert len(index) <= 2 * pool.num_blocks
    live = pool.allocate(2)
    for b in live:
        index.remember(b, pool.generation[b], f"live-{b}")
    assert index.held_digests() == {f"live-{b}" for b in live}
    assert [index.block_of(f"live-{b}") for b in live] == live
