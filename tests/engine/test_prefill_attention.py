"""Prefill attention after cached history: the split pass (history + causal chunk, merged by
log-sum-exp) against the reference (history and chunk gathered, one masked SDPA).

Random K/V in a paged cache with the sequence's blocks out of order, histories that end inside
a block and on a block boundary, GQA, MQA and plain multi-head; then the whole layer forward
(K/V written to their slots first) on the fast and the reference path.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import assert_logits_close, our_logits, prompt_of
from workers.checkpoint import Arch
from workers.kernels.fast_path import FastPath
from workers.model import attention as attention_module
from workers.model.attention import Attention
from workers.model.config import AttentionShape
from workers.model.forward_batch import ForwardBatch, PrefillSegment

BLOCK = 4


def _layer(n_heads: int, n_kv_heads: int, seed: int) -> Attention:
    torch.manual_seed(seed)
    shape = AttentionShape(
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=8, rotary_dim=0, rope_theta=1e4, scale=8**-0.5, bias=False
    )
    layer = Attention(n_heads * 8, shape).requires_grad_(False)
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.3
    return layer


def _chunk(layer: Attention, context: int, n: int, seed: int):
    """A cache holding `context` tokens of history in scattered blocks, and the next n tokens' q/k/v."""
    s = layer.shape
    g = torch.Generator().manual_seed(seed)
    blocks = -(-(context + n) // BLOCK)
    table = torch.randperm(blocks, generator=g) + 3  # not in order, not from block 0
    kv = torch.randn(2, blocks + 5, BLOCK, s.n_kv_heads, s.head_dim, generator=g)
    q = torch.randn(n, s.n_heads, s.head_dim, generator=g)
    k, v = (torch.randn(n, s.n_kv_heads, s.head_dim, generator=g) for _ in range(2))
    pos = torch.arange(context, context + n)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    kv[0].view(-1, s.n_kv_heads, s.head_dim)[slots] = k  # as forward writes them before attending
    kv[1].view(-1, s.n_kv_heads, s.head_dim)[slots] = v
    return q, k, v, kv, PrefillSegment(0, n, context, table, 0), slots


@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("context,n", [(13, 7), (16, 16), (40, 1), (5, 33)])
def test_split_prefill_equals_masked_reference(n_heads, n_kv_heads, context, n):
    layer = _layer(n_heads, n_kv_heads, seed=n_heads + context)
    q, k, v, kv, seg, _ = _chunk(layer, context, n, seed=context * 7 + n)
    ref = layer._prefill(q, k, v, kv, seg)
    fast = layer._prefill_split(q, k, v, kv, seg)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    # A wrong merge (say, dropping the history pass) would be far off: the history matters.
    no_history = layer._prefill(q, k, v, kv, PrefillSegment(0, n, 0, seg.block_table, 0))
    assert (no_history - ref).abs().max() > 1e-2


def test_layer_forward_fast_equals_reference_on_a_chunk_after_history():
    layer = _layer(8, 2, seed=1)
    s = layer.shape
    context, n = 21, 11
    _, _, _, kv, seg, slots = _chunk(layer, context, n, seed=3)
    h = torch.randn(n, s.n_heads * s.head_dim)
    batch = ForwardBatch(torch.zeros(n, dtype=torch.long), torch.arange(context, context + n), slots, (seg,), None)
    ref = layer(h, batch, kv.clone(), None)
    layer.fast = FastPath(on=True)  # no kernel at all: the split pass is pure torch
    fast = layer(h, batch, kv.clone(), None)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
def test_chunked_prefill_on_the_fast_path_equals_one_shot_reference(tiny, arch):
    """A prompt run as chunks after growing history (split attention, recurrent scan) gives the
    logits of the one-shot reference path (masked SDPA never needed, SSD scan), argmax equal."""
    model, ids = tiny[arch].ours, prompt_of(70, seed=5)
    fast = our_logits(model, ids, chunks=[23, 17, 1, 29], fast_kernels=True)
    ref = our_logits(model, ids, fast_kernels=False)
    assert_logits_close(fast, ref)
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))


def test_split_prefill_gathers_only_the_history_blocks():
    """The chunk's own K/V come from `k`, `v`: its blocks are never read. Entries past the
    history's blocks that point nowhere valid change nothing (reading them would fail)."""
    layer = _layer(8, 2, seed=4)
    context, n = 13, 20  # history ends inside its 4th block; the chunk fills 5 more
    q, k, v, kv, seg, _ = _chunk(layer, context, n, seed=9)
    ref = layer._prefill(q, k, v, kv, seg)
    history_blocks = -(-context // BLOCK)
    nowhere = seg.block_table.clone()
    nowhere[history_blocks:] = kv.shape[1] + 1000
    fast = layer._prefill_split(q, k, v, kv, PrefillSegment(0, n, context, nowhere, 0))
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_fresh_prompts_batched_equal_reference():
    """Adjacent fresh prompts of one length run as one batched attention (`_prefill_fresh`);
    a prompt after history, a lone length and a run after it stay per segment. Every row equals
    the reference's per-segment path."""
    layer = _layer(8, 2, seed=5)
    s = layer.shape
    lengths = [(6, 0), (6, 0), (6, 0), (5, 9), (5, 0), (5, 0), (3, 0)]  # (tokens, cached history)
    g = torch.Generator().manual_seed(11)
    kv = torch.randn(2, 64, BLOCK, s.n_kv_heads, s.head_dim, generator=g)
    segs, slots, positions, start, next_block = [], [], [], 0, 1
    for i, (n, context) in enumerate(lengths):
        blocks = -(-(context + n) // BLOCK)
        table = torch.arange(next_block, next_block + blocks)
        next_block += blocks
        pos = torch.arange(context, context + n)
        segs.append(PrefillSegment(start, n, context, table, i))
        slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
        positions.append(pos)
        start += n
    assert attention_module._fresh_runs(tuple(segs)) == [(0, 3, 6), (23, 2, 5)]
    h = torch.randn(start, s.n_heads * s.head_dim, generator=g)
    ids = torch.zeros(start, dtype=torch.long)
    batch = ForwardBatch(ids, torch.cat(positions), torch.cat(slots), tuple(segs), None)
    ref = layer(h, batch, kv.clone(), None)
    layer.fast = FastPath(on=True)
    torch.testing.assert_close(layer(h, batch, kv.clone(), None), ref, rtol=1e-5, atol=1e-5)
