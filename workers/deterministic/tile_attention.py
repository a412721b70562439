r"""Attention of a tile's queries over key blocks aligned to absolute positions, folded in a
fixed order (an online softmax), so no reduction's order depends on the context length.

    positions:  0 ........ T | T ....... 2T | 2T ...... 3T |  3T .. tile .. 4T
    key block:      j = 0    |    j = 1     |    j = 2     |   the tile's own keys (causal)
                    from the paged cache, one block per step  |   folded last

A key block is cut at tile boundaries, not at KV pages: the two grids are independent, and
the keys of positions [jT, (j+1)T) are gathered position by position through the block table

    pages (bs = 6):  | p0    | p1    | p2    | p3    | ...        T = 8
    positions:       0 1 2 3 4 5 6 7 8 9 ...
    key block j=1:                   [8 ........... 15]  = p1[2:6] + p2[0:4]

so the bits of a pass depend on the tokens and absolute positions only, whatever the KV
block size. Every step has the shape [G, H, T, T]. A row with fewer history blocks than the longest one
sees its missing blocks fully masked: the running maximum stays, the rescale factor is
exp(0) = 1 and the added terms are exact zeros, so its bits are those of a pass with only
its own blocks. The running maximum starts at a finite floor, not -inf, for the same
reason (exp(-inf - -inf) would be NaN).
"""

from __future__ import annotations

import torch

_FLOOR = -1e30


def gather_key_block(cache: torch.Tensor, tables: torch.Tensor, j: int, window: int) -> torch.Tensor:
    """Keys (or values) of positions [jT, (j+1)T) of every row: [G, T, kv, d].

        cache [num_blocks, bs, kv, d];  tables [G, pages], pages >= ceil((j+1)T / bs)
        position p = page tables[:, p // bs], offset p % bs
    """
    bs = cache.shape[1]
    positions = torch.arange(j * window, (j + 1) * window, device=tables.device)
    slots = tables[:, positions // bs] * bs + positions % bs  # [G, T]
    return cache.flatten(0, 1)[slots]


def tile_attention(
    q: torch.Tensor,  # [G, T, H, d], rotated
    k: torch.Tensor,  # [G, T, kv, d], the tile's own keys
    v: torch.Tensor,  # [G, T, kv, d]
    kv_cache: torch.Tensor,  # [2, num_blocks, bs, kv, d]
    tables: torch.Tensor,  # [G, pages] long, NULL-padded; row r's first ceil(k_r*T/bs) pages hold its history
    history_blocks: torch.Tensor,  # [G] long: k_r = tile start / T
    scale: float,
) -> torch.Tensor:
    """Returns [G, T, H, d]."""
    g, t, h, _ = q.shape
    rep = h // k.shape[2]
    qh = q.transpose(1, 2).float()  # [G, H, T, d]
    m = torch.full((g, h, t, 1), _FLOOR, dtype=torch.float32, device=q.device)
    denom = torch.zeros((g, h, t, 1), dtype=torch.float32, device=q.device)
    acc = torch.zeros((g, h, t, q.shape[3]), dtype=torch.float32, device=q.device)

    def fold(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
        nonlocal m, denom, acc
        kh = keys.float().repeat_interleave(rep, dim=2).transpose(1, 2)  # [G, H, T, d]
        vh = values.float().repeat_interleave(rep, dim=2).transpose(1, 2)
        scores = torch.matmul(qh, kh.transpose(2, 3)) * scale  # [G, H, T, T]
        scores = scores.masked_fill(~mask, -torch.inf)
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        p = torch.exp(scores - m_new)
        rescale = torch.exp(m - m_new)
        denom = denom * rescale + p.sum(dim=-1, keepdim=True)
        acc = acc * rescale + torch.matmul(p, vh)
        m = m_new

    for j in range(int(history_blocks.max()) if g else 0):
        present = (history_blocks > j)[:, None, None, None]  # [G, 1, 1, 1]
        fold(
            gather_key_block(kv_cache[0], tables, j, t),
            gather_key_block(kv_cache[1], tables, j, t),
            present.expand(g, h, t, t),
        )
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device))
    fold(k, v, causal[None, None].expand(g, h, t, t))
    return (acc / denom).transpose(1, 2).to(q.dtype)
