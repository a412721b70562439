"""Grouped-query attention over the paged KV cache.

K/V of the step's tokens are first written to their cache slots; each sequence then reads
its keys back through its block table, so a prefill chunk, a cache hit and a decode step all
see exactly the cached history.

    block_table = [7, 2, 9]   block_size = 4
    position:      0 1 2 3 | 4 5 6 7 | 8 9
    cache block:   7 . . . | 2 . . . | 9 .        kv slot of position p = table[p // 4] * 4 + p % 4
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.fast_path import REFERENCE, FastPath
from workers.model.config import AttentionShape
from workers.model.forward_batch import ForwardBatch, PrefillSegment
from workers.model.layers import apply_rotary


class Attention(nn.Module):
    def __init__(self, hidden: int, shape: AttentionShape):
        super().__init__()
        self.shape = shape
        q_dim, kv_dim = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
        self.qkv = nn.Linear(hidden, q_dim + 2 * kv_dim, bias=shape.bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=shape.bias)
        self.fast: FastPath = REFERENCE

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        s = self.shape
        n = h.shape[0]
        q, k, v = self.qkv(h).split([s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_kv_heads * s.head_dim], -1)
        q = q.view(n, s.n_heads, s.head_dim)
        k = k.view(n, s.n_kv_heads, s.head_dim)
        v = v.view(n, s.n_kv_heads, s.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)

        group = batch.decode
        fp32 = q.dtype == kv_cache.dtype == torch.float32
        fused = self.fast.decode is not None and fp32
        if batch.pure_decode and fused:
            # A pure decode step: each sequence's K/V written to its slot and attended in one kernel.
            return self.o_proj(self._decode_paged(q, kv_cache, batch, k, v).reshape(n, -1))

        flat_k = kv_cache[0].view(-1, s.n_kv_heads, s.head_dim)
        flat_v = kv_cache[1].view(-1, s.n_kv_heads, s.head_dim)
        flat_k[batch.kv_slots] = k
        flat_v[batch.kv_slots] = v

        decode = self._decode_paged if fused else self._decode
        if batch.pure_decode:  # rows in order
            return self.o_proj(decode(q, kv_cache, batch).reshape(n, -1))
        out = torch.empty(n, s.n_heads, s.head_dim, dtype=h.dtype, device=h.device)
        prefill = self._prefill_split if self.fast.on and fp32 else self._prefill  # needs no kernel
        batched: set[int] = set()  # token_start of the segments already attended in a run
        for first, count, length in _fresh_runs(batch.prefills) if self.fast.on else []:
            rows = slice(first, first + count * length)
            out[rows] = self._prefill_fresh(q[rows], k[rows], v[rows], count, length)
            batched.update(range(first, first + count * length, length))
        for seg in batch.prefills:
            if seg.token_start in batched:
                continue
            rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
            out[rows] = prefill(q[rows], k[rows], v[rows], kv_cache, seg)
        if group is not None:
            out[group.token_index] = decode(q[group.token_index], kv_cache, batch)
        return self.o_proj(out.reshape(n, -1))

    def _prefill(self, q, k, v, kv_cache, seg) -> torch.Tensor:
        s = self.shape
        if seg.context_len == 0:
            keys, values, mask, causal = k, v, None, True
        else:
            total = seg.context_len + seg.num_tokens
            keys = _gather(kv_cache[0], seg.block_table[None])[0, :total]
            values = _gather(kv_cache[1], seg.block_table[None])[0, :total]
            # Query i sits at absolute position context_len + i and sees keys 0..context_len+i.
            q_pos = torch.arange(seg.num_tokens, device=q.device)[:, None] + seg.context_len
            mask, causal = torch.arange(total, device=q.device)[None, :] <= q_pos, False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=causal,
            scale=s.scale,
            enable_gqa=s.n_heads != s.n_kv_heads,
        )
        return out[0].transpose(0, 1)

    def _prefill_fresh(self, q, k, v, count: int, length: int) -> torch.Tensor:
        """`_prefill` of `count` fresh prompts of `length` tokens each, adjacent rows, as one
        batched causal SDPA over views of the rows (no per-prompt call, no copies in)."""
        s = self.shape
        heads = [t.view(count, length, t.shape[1], s.head_dim).transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(
            *heads, is_causal=True, scale=s.scale, enable_gqa=s.n_heads != s.n_kv_heads
        )  # fmt: skip
        return out.transpose(1, 2).reshape(count * length, s.n_heads, s.head_dim)

    def _prefill_split(self, q, k, v, kv_cache, seg) -> torch.Tensor:
        """`_prefill` without the [chunk x history+chunk] mask: a chunk after cached history is
        two flash-attention passes merged by their log-sum-exps, so no masked-out key is scored.

            keys:  [ history 0..context_len-1 | this chunk 0..n-1 ]
                     every query sees all        query i sees 0..i  (causal, square)
            out = (o_hist * exp(lse_hist - m) + o_new * exp(lse_new - m)) / (same weights summed)

        Only the history's blocks are gathered (the chunk's own K/V are `k`, `v`):

            block_table   [    7    |    2    |    9     |  4 ]    block_size 4
            positions      0 1 2 3   4 5 6 7   8 9 10 11   12
                           history 0..5 | chunk 6..12            context_len 6
            gathered       table[: ceil(6 / 4)] = [7, 2], then positions 0..5 of them
        """
        if seg.context_len == 0:
            return self._prefill(q, k, v, kv_cache, seg)
        s = self.shape
        hist = seg.block_table[None, : -(-seg.context_len // kv_cache.shape[2])]
        keys = _gather(kv_cache[0], hist)[0, : seg.context_len]
        values = _gather(kv_cache[1], hist)[0, : seg.context_len]
        heads = [t.transpose(0, 1)[None] for t in (q, keys, values, k, v)]  # [1, heads, tokens, d]
        o_hist, lse_hist = _flash(heads[0], heads[1], heads[2], causal=False, scale=s.scale)
        o_new, lse_new = _flash(heads[0], heads[3], heads[4], causal=True, scale=s.scale)
        top = torch.maximum(lse_hist, lse_new)
        w_hist, w_new = (lse_hist - top).exp_()[..., None], (lse_new - top).exp_()[..., None]
        out = (o_hist * w_hist + o_new * w_new) / (w_hist + w_new)
        return out[0].transpose(0, 1).to(q.dtype)

    def _decode_paged(self, q, kv_cache, batch: ForwardBatch, k=None, v=None) -> torch.Tensor:
        """`_decode` reading K/V blocks in place through the block tables (no padded copy of
        the batch's history each step): one pass with an online softmax per sequence and head.
        With `k`, `v` (this step's, one row per sequence), the kernel first writes them to
        `batch.kv_slots`, as `forward` does for the reference."""
        group = batch.decode
        new = {} if k is None else {"k_new": k, "v_new": v, "kv_slots": batch.kv_slots}
        return self.fast.decode.paged_decode_attention(
            q, kv_cache[0], kv_cache[1], group.block_tables, group.num_keys, self.shape.scale, **new
        )

    def _decode(self, q, kv_cache, batch: ForwardBatch) -> torch.Tensor:
        """Reference decode attention: the batch's K/V gathered into padded tensors, masked SDPA."""
        s = self.shape
        group = batch.decode
        keys = _gather(kv_cache[0], group.block_tables)  # [B, L, kv, d]
        values = _gather(kv_cache[1], group.block_tables)
        valid = torch.arange(keys.shape[1], device=q.device)[None, :] <= group.context_lens[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [B, H, 1, d]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=s.scale,
            enable_gqa=s.n_heads != s.n_kv_heads,
        )
        return out[:, :, 0, :]


def _fresh_runs(segments: tuple[PrefillSegment, ...]) -> list[tuple[int, int, int]]:
    """Runs of at least two adjacent fresh prompts (no cached history) of one length, as
    (first row, prompts, length): each is one batched attention call.

        rows:   [ A 128 | B 128 | C 128 | D 40 (history) | E 64 | F 64 ]
        runs:     (0, 3, 128)                              (424, 2, 64)
    """
    runs: list[tuple[int, int, int]] = []
    for seg in segments:
        if seg.context_len != 0:
            continue
        if runs:
            first, count, length = runs[-1]
            if seg.num_tokens == length and seg.token_start == first + count * length:
                runs[-1] = (first, count + 1, length)
                continue
        runs.append((seg.token_start, 1, seg.num_tokens))
    return [run for run in runs if run[1] > 1]


def _flash(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention returning (out [1, Hq, n, d], logsumexp [1, Hq, n]); kv heads may be
    fewer than query heads (grouped-query attention)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv, d] gathered by [B, max_blocks] -> [B, max_blocks * block_size, kv, d]."""
    b, m = block_tables.shape
    return cache[block_tables].reshape(b, m * cache.shape[1], cache.shape[2], cache.shape[3])
