"""Pools too small for every conversation's head: committed heads are evicted (LRU, never
one an in-flight turn uses), every turn still equals the stateless reference, and a turn
whose head was evicted recomputes from the ledger's token ids and counts as a miss.

Three kinds of pressure: the head budget (head_cache_bytes), KV blocks (kv_cache_bytes:
the block pool reclaims heads), Mamba state slots (num_state_slots: the slot pool reclaims).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    assert_same_output,
    conversation,
    drive,
    greedy,
    head_of,
    new_cache,
    new_engine,
    reference_prompt,
    run_stateless,
    user,
)
from workers.cache.layout import layouts_for
from workers.checkpoint import Arch
from workers.model.loader import read_model_config

CONVERSATIONS = ["c0", "c1", "c2", "c3"]
ROUNDS = 3


def sizes(model_dir: Path) -> tuple[int, int]:
    """(bytes of one KV block, bytes of one Mamba state slot) of the model at block size 8."""
    kv, state = layouts_for(read_model_config(Path(model_dir)), 1, 8, 1, torch.float32)
    return kv.block_bytes, state.slot_bytes


PRESSURES = {
    # (engine limits from (block bytes, slot bytes), conversations in flight together)
    "head_budget": (lambda bb, sb: {"head_cache_bytes": 2 * (2 * sb + 6 * bb)}, 4),
    "kv_blocks": (lambda bb, sb: {"kv_cache_bytes": 40 * bb}, 2),
    "state_slots": (lambda bb, sb: {"num_state_slots": 6}, 2),
}


@pytest.mark.parametrize("pressure", list(PRESSURES))
def test_evictions_keep_every_conversation_exact(models, reference_engines, pressure):
    arch = Arch.GRANITEMOEHYBRID
    limits, in_flight = PRESSURES[pressure]
    eng = new_engine(models[arch], **limits(*sizes(models[arch])))
    cc = new_cache(eng)
    ref = reference_engines[arch]
    evicted_turns = hit_turns = 0
    for rnd in range(ROUNDS):
        for first in range(0, len(CONVERSATIONS), in_flight):
            group = CONVERSATIONS[first : first + in_flight]
            misses_before = cc.stats().get("misses", 0)
            expected_cached, histories, messages, params = {}, {}, {}, {}
            for i, cid in enumerate(group):
                conv = conversation(cc, cid, "s")
                head = head_of(cc, cid, "s")
                expected_cached[cid] = head.state_len if head else 0
                evicted_turns += conv is not None and head is None
                hit_turns += head is not None
                histories[cid] = cc.describe(ConversationRef(cid, "s"))["messages"] if conv else []
                messages[cid] = user(f"round {rnd} for {cid}")
                params[cid] = greedy(5 + 2 * i)  # finishing at different steps
                cc.begin_turn(ConversationRef(cid, "s"), messages[cid], params[cid], f"{cid}-{rnd}")
            results = drive(eng)
            expected = run_stateless(
                ref,
                {f"{cid}-{rnd}": reference_prompt(ref, histories[cid], messages[cid]) for cid in group},
                {f"{cid}-{rnd}": params[cid] for cid in group},
            )
            for cid in group:
                rid = f"{cid}-{rnd}"
                assert_same_output(results[rid], expected[rid], f"{pressure}: {rid}")
                assert results[rid].num_cached_tokens == expected_cached[cid], rid
            misses = sum(1 for cid in group if rnd > 0 and expected_cached[cid] == 0)
            assert cc.stats().get("misses", 0) == misses_before + misses
    stats = cc.stats()
    assert stats["evictions"] > 0, stats
    assert evicted_turns > 0, "some conversation continued after its head was evicted"
    assert hit_turns > 0, "and some still found their head"
    assert stats["hits"] == hit_turns and stats["misses"] == evicted_turns



def two_long_turns(models, reference_engines, usable_blocks: int):
    """Conversations a and b (one 30-token head each, 4 blocks), then a long turn of each at
    once in a pool of `usable_blocks` blocks: each turn grows to 12 blocks (3 shared)."""
    arch = Arch.BAMBA
    block_bytes, _ = sizes(models[arch])
    eng = new_engine(models[arch], kv_cache_bytes=usable_blocks * block_bytes)
    cc = new_cache(eng)
    ref = reference_engines[arch]
    for cid in ("a", "b"):
        cc.begin_turn(ConversationRef(cid, "s"), user(f"hello {cid}"), greedy(6), f"{cid}-1")
    drive(eng)
    heads = {cid: head_of(cc, cid, "s") for cid in ("a", "b")}
    assert [h.state_len for h in heads.values()] == [30, 30]
    histories = {cid: cc.describe(ConversationRef(cid, "s"))["messages"] for cid in heads}
    long = greedy(40, ignore_eos=True)
    requests = {cid: cc.begin_turn(ConversationRef(cid, "s"), user("a long answer"), long, f"{cid}-2") for cid in heads}
    results = drive(eng, max_steps=300)
    assert sum(r.num_preemptions for r in requests.values()) > 0, "the pool was meant to force a preemption"
    expected = run_stateless(
        ref, {f"{cid}-2": reference_prompt(ref, histories[cid], user("a long answer")) for cid in heads}, long
    )
    for cid in heads:
        assert_same_output(results[f"{cid}-2"], expected[f"{cid}-2"], cid)
    return cc, heads, results


def test_preempted_turn_reattaches_its_pinned_head(models, reference_engines):
    """20 blocks: both turns cannot grow together, so b's turn is preempted (its state freed)
    and re-admitted from its head once a's turn is done (pinned meanwhile, never evicted; a's
    new head may be evicted to make room)."""
    cc, heads, results = two_long_turns(models, reference_engines, usable_blocks=20)
    for cid, head in heads.items():
        assert results[f"{cid}-2"].num_cached_tokens == head.state_len
    assert cc.stats()["published"] == 4 and cc.stats().get("misses", 0) == 0


def test_waiting_turns_pinned_heads_do_not_deadlock_the_pool(models, reference_engines):
    """16 blocks: a's turn alone needs 9 blocks of its own besides its head's 4, so it fits
    next to its own head (13 <= 16) but not next to b's head too (17), which b's waiting
    turn pins. a's turn gets preempted and, queued first (FCFS), can never be re-admitted
    while b's head stays pinned: both turns wait forever. A turn that fits the pool alone
    must complete (e.g. by not pinning the heads of waiting turns, which can recompute
    from their token ids when their head is gone)."""
    cc, heads, results = two_long_turns(models, reference_engines, usable_blocks=16)
    assert cc.stats()["published"] == 4


@pytest.mark.parametrize("exported", [False, True])
def test_a_head_the_tier_holds_goes_before_one_held_only_here(models, exported):
    """Room for two heads, three conversations: the third's head evicts one. Least recently
    used, c0's would go; but where the worker exported c1's head (the state tier holds a copy,
    its next turn imports it), c1's goes first and c0's, which only this engine holds and which
    would be recomputed from its ledger, stays."""
    arch = Arch.GRANITEMOEHYBRID
    eng = new_engine(models[arch], **PRESSURES["head_budget"][0](*sizes(models[arch])))
    cc = new_cache(eng)
    for cid in ("c0", "c1"):
        cc.begin_turn(ConversationRef(cid, "s"), user(f"hello {cid}"), greedy(5), f"{cid}-1")
        drive(eng)
    if exported:
        cc.mark_in_tier(ConversationRef("c1", "s"), head_of(cc, "c1", "s").version)
    cc.begin_turn(ConversationRef("c2", "s"), user("hello c2"), greedy(5), "c2-1")
    drive(eng)
    held = {cid for cid in ("c0", "c1", "c2") if head_of(cc, cid, "s") is not None}
    assert held == ({"c0", "c2"} if exported else {"c1", "c2"})
    assert cc.stats()["evictions"] == 1
