"""A deterministic conversation turn gives the same bits on a cache hit, a forced miss and
after export -> import into another engine; tiles restarting below the committed length
never write into blocks shared with the head; heads the fast path made are not reused."""

from __future__ import annotations

import pytest
import torch

from tests.determinism.helpers import Arrival, background_load, det_params, new_engine
from workers.checkpoint import Arch
from workers.conversation.cache import ConversationCache
from workers.request import FinishReason
from workers.conversation.export import build_export, verify_export
from workers.conversation.prompt import build_turn_prompt
from proto.contract import ConversationRef
from workers.sampling import SamplingParams

C1 = ConversationRef("c1", "s")  # the conversation most tests here use

TURN1 = [{"role": "user", "content": "tell me, how are the tiles doing?"}]
TURN2 = [{"role": "user", "content": "and once more"}]
W = 16


def _turn(cc: ConversationCache, suffix, params, rid: str):
    request = cc.begin_turn(C1, suffix, params, rid)
    tokens = []
    while cc.engine.has_unfinished():
        for out in cc.engine.step():
            assert out.error is None, out.error
            tokens += [(t.token_id, None if t.logprob is None else t.logprob.hex()) for t in out.new_tokens]
    return request, tokens


def _head(cc: ConversationCache, turn: int):
    return cc.head_of(C1, turn)


def _state_bytes(cc: ConversationCache, head) -> tuple:
    engine, bs = cc.engine, cc.engine.kv_layout.block_size
    pos = torch.arange(head.state_len)
    flat = torch.tensor(engine.caches.kv.table(head.holder))[pos // bs] * bs + pos % bs
    kv = tuple(c.flatten(1, 2)[:, flat].contiguous().numpy().tobytes() for c in engine.runner.caches.kv)
    slots = engine.caches.states.slots[head.holder]
    mamba = tuple(t[s].contiguous().numpy().tobytes() for s in slots for t in engine.runner.caches.conv + engine.runner.caches.ssm)
    return head.state_len, head.aligned_len, head.canonical_window, kv, mamba


def _cache(model_dir, **kw) -> ConversationCache:
    return ConversationCache(new_engine(model_dir, **kw), retain_turns=1)


@pytest.fixture(scope="module")
def model(det_models):
    return det_models[Arch.BAMBA]


def test_hit_miss_and_import_give_the_same_bits(model):
    params = det_params(max_tokens=14)
    hit = _cache(model)
    _turn(hit, TURN1, params, "t1")
    head1 = _head(hit, 1)
    assert head1.canonical_window == W and head1.aligned_len >= W and head1.aligned_len % W == 0
    exported = build_export(hit.snapshot_head(C1))
    ledger = hit.describe(C1)

    request, hit_tokens = _turn(hit, TURN2, params, "t2")
    assert request.num_cached_tokens == head1.aligned_len > 0  # restarted at the canonical state

    miss = _cache(model)
    _turn(miss, TURN1, params, "t1")
    miss.engine.caches.heads.drop(_head(miss, 1))  # forced miss: the whole prompt is recomputed
    request, miss_tokens = _turn(miss, TURN2, params, "t2")
    assert request.num_cached_tokens == 0

    imported = _cache(model)
    imported.adopt_ledger(C1, version=ledger["version"], turns=ledger["ledger"])
    identity, layout = imported.export_identity()
    imported.install_head(C1, verify_export(exported.header, dict(exported.chunks), identity, layout, set()))
    assert _head(imported, 1).canonical_window == W
    request, imported_tokens = _turn(imported, TURN2, params, "t2")
    assert request.num_cached_tokens == head1.aligned_len

    assert len(hit_tokens) == 14 and hit_tokens == miss_tokens == imported_tokens
    assert _state_bytes(hit, _head(hit, 2)) == _state_bytes(miss, _head(miss, 2)) == _state_bytes(imported, _head(imported, 2))


def test_a_tile_restart_never_writes_into_blocks_shared_with_the_head(model):
    bs = 4
    for max_tokens in range(8, 8 + W):  # a committed length with full blocks past the aligned state
        cc = _cache(model)
        _turn(cc, TURN1, det_params(max_tokens=max_tokens), "t1")
        head = _head(cc, 1)
        shared = range(head.aligned_len // bs, head.state_len // bs)  # full blocks the restart recomputes
        if len(shared) >= 2:
            break
    assert len(shared) >= 2
    block = cc.engine.caches.kv.table(head.holder)[shared[0]]
    kv = cc.engine.runner.caches.kv[0]
    kv[0, block] += 1.0  # marks the head's copy: a write from the tile would erase the mark
    marked = kv[0, block].clone()
    request, _ = _turn(cc, TURN2, det_params(max_tokens=6), "t2")
    assert request.num_cached_tokens == head.aligned_len
    assert block in cc.engine.caches.kv.table(_head(cc, 2).holder)  # still shared, by the new head
    assert kv[0, block].equal(marked)


def test_a_head_made_by_the_fast_path_is_recomputed_not_reused(model):
    ordinary = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    outcomes = []
    for force_miss in (False, True):
        cc = _cache(model)
        _turn(cc, TURN1, ordinary, "t1")
        assert _head(cc, 1).canonical_window == 0
        if force_miss:
            cc.engine.caches.heads.drop(_head(cc, 1))
        request, tokens = _turn(cc, TURN2, det_params(max_tokens=10), "t2")
        assert request.num_cached_tokens == 0 and request.head is None
        outcomes.append((tokens, _state_bytes(cc, _head(cc, 2))))
        assert cc.stats()["misses"] == 1
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1][2] == W  # the new head is canonical


def _run_with_load(cc: ConversationCache, start, load: list[Arrival]) -> tuple[object, list]:
    """`start()` begins a conversation request; ordinary requests arrive beside it at their
    steps. Returns (the request, its streamed (token, logprob bits)); its last output must say
    it finished (a stream waits for that output)."""
    request = start()
    pending, step, streamed, last = sorted(load, key=lambda a: a.step), 0, [], None
    while pending or cc.engine.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            cc.engine.add_request(a.request_id, a.prompt, a.params)
        for out in cc.engine.step():
            assert out.error is None, out.error
            if out.request_id == request.request_id:
                streamed += [(t.token_id, t.logprob.hex()) for t in out.new_tokens]
                last = out
        step += 1
    assert last is not None and last.finished and last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), last
    return request, streamed


TURNS = [TURN1, TURN2, [{"role": "user", "content": "a third one, to cross another tile"}]]


@pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
def test_a_canonical_materialization_rebuilds_the_lost_head_bit_for_bit(det_models, arch):
    """Recovery from the ledger for a deterministic conversation: a second engine adopts the
    ledger and materializes the head through the tiles. Its KV over the committed length, its
    terminal and aligned Mamba states are the original's bits, though the original was built
    by prefill + verified decode over three turns with other requests batched beside it and
    the rebuild is one prefill beside other requests; the next deterministic turn then streams
    the same tokens and logprob bits on both engines."""
    original = _cache(det_models[arch])
    for i, suffix in enumerate(TURNS):
        load = background_load(seed=10 + i, max_requests=6)
        _run_with_load(original, lambda: original.begin_turn(C1, suffix, det_params(max_tokens=11 + i), f"t{i}"), load)
    lost = _head(original, len(TURNS))
    assert lost.canonical_window == W and lost.aligned_len >= 2 * W and lost.state_len > lost.aligned_len
    ledger = original.describe(C1)

    rebuilt = _cache(det_models[arch])
    rebuilt.adopt_ledger(C1, version=ledger["version"], turns=ledger["ledger"])
    request, streamed = _run_with_load(
        rebuilt, lambda: rebuilt.materialize_head(C1, "rebuild", canonical=True), background_load(seed=99, max_requests=5)
    )
    assert streamed == [] and request.num_computed_tokens == lost.state_len
    head = _head(rebuilt, len(TURNS))
    assert (head.version, head.turn) == (lost.version, lost.turn)
    assert _state_bytes(rebuilt, head) == _state_bytes(original, lost)

    params = det_params(max_tokens=12)
    nxt = [{"role": "user", "content": "and after the recovery?"}]
    a_request, a = _run_with_load(original, lambda: original.begin_turn(C1, nxt, params, "n1"), background_load(seed=5))
    b_request, b = _run_with_load(rebuilt, lambda: rebuilt.begin_turn(C1, nxt, params, "n2"), [])
    assert a_request.num_cached_tokens == b_request.num_cached_tokens == lost.aligned_len > 0, "both continue the head"
    assert len(a) == 12 and a == b
    assert _state_bytes(original, _head(original, 4)) == _state_bytes(rebuilt, _head(rebuilt, 4))


@pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
def test_a_canonical_rebuild_one_token_past_a_tile_boundary_is_bit_identical(det_models, arch):
    """A rebuild runs the committed tokens but the last: P = committed - 1. With committed
    = 2 (mod W), P = kW + 1 and the tile ending at kW leaves one prompt token over. It must
    run in a tile too: on the fast path the head would hold fast-path K/V and Mamba state at
    kW while being labelled canonical."""
    original = _cache(det_models[arch])
    prompt = build_turn_prompt(original.engine.tokenizer, [], [], TURN1).token_ids
    max_tokens = (2 - len(prompt)) % W + W  # the reply crosses a tile boundary as well
    _turn(original, TURN1, det_params(max_tokens=max_tokens), "t1")
    lost = _head(original, 1)
    assert lost.state_len % W == 1 and lost.state_len > W and lost.canonical_window == W
    ledger = original.describe(C1)

    rebuilt = _cache(det_models[arch])
    rebuilt.adopt_ledger(C1, version=ledger["version"], turns=ledger["ledger"])
    rebuild = lambda: rebuilt.materialize_head(C1, "rebuild", canonical=True)  # noqa: E731
    request, streamed = _run_with_load(rebuilt, rebuild, background_load(seed=3, max_requests=5))
    assert streamed == [] and request.num_computed_tokens == lost.state_len
    assert _state_bytes(rebuilt, _head(rebuilt, 1)) == _state_bytes(original, lost)


def test_a_fast_path_head_serves_ordinary_turns_and_a_canonical_request_replaces_it(det_models):
    """One rule for which heads a deterministic turn continues: only canonical ones. A head
    materialized on the fast path is not canonical (a deterministic turn would recompute
    everything), so asking for a canonical head rebuilds it in tiles and replaces it; asking
    again then finds it held."""
    original = _cache(det_models[Arch.BAMBA])
    _turn(original, TURN1, det_params(max_tokens=14), "t1")
    ledger = original.describe(C1)
    rebuilt = _cache(det_models[Arch.BAMBA])
    rebuilt.adopt_ledger(C1, version=ledger["version"], turns=ledger["ledger"])
    _run_with_load(rebuilt, lambda: rebuilt.materialize_head(C1, "fast"), [])
    fast = _head(rebuilt, 1)
    assert fast.canonical_window == 0 and fast.state_len == _head(original, 1).state_len
    assert rebuilt.materialize_head(C1, "again") is None, "any held head serves a fast-path request"

    _run_with_load(rebuilt, lambda: rebuilt.materialize_head(C1, "tiles", canonical=True), [])
    canonical = _head(rebuilt, 1)
    assert canonical is not fast and fast.holder not in rebuilt.engine.caches.kv.tables
    assert _state_bytes(rebuilt, canonical) == _state_bytes(original, _head(original, 1))
    assert rebuilt.materialize_head(C1, "again", canonical=True) is None
    assert rebuilt.stats()["materialized"] == 2 and rebuilt.head_count() == 1
