"""Mamba2's state-space duality (SSD) scan: chunked for prompts, recurrent for decode.

A minimal, readable formulation after the SSD reference (state-spaces/mamba,
`ssd_minimal.py`), extended to start from an existing state so that a chunked
prefill, a cache hit and a fresh prompt all run the same function.

Shapes: b = sequences, l = tokens, h = heads, p = head dim, g = groups, n = state size.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=16)
def _triangles(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=device), diagonal=-1)
    on_or_below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=device), diagonal=0)
    return below, on_or_below


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, -inf above the diagonal."""
    size = x.size(-1)
    below, on_or_below = _triangles(size, x.device)
    x = x[..., None].expand(*x.size(), size).masked_fill(~below, 0)
    return torch.cumsum(x, dim=-2).masked_fill(~on_or_below, -torch.inf)


def _to_chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[b, l, ...] -> [b, l // chunk, chunk, ...] (l already a multiple of chunk)."""
    return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])


def chunked_scan(
    x: torch.Tensor,  # [b, l, h, p]
    dt: torch.Tensor,  # [b, l, h], after softplus and clamping
    A: torch.Tensor,  # [h], negative
    B: torch.Tensor,  # [b, l, g, n]
    C: torch.Tensor,  # [b, l, g, n]
    chunk_size: int,
    initial_state: torch.Tensor,  # [b, h, p, n]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y [b, l, h, p] (without the D skip term) and the state after the last token."""
    b, length, h, _ = x.shape
    heads_per_group = h // B.shape[2]
    pad = (chunk_size - length % chunk_size) % chunk_size

    x = F.pad(x.float() * dt[..., None].float(), (0, 0, 0, 0, 0, pad))
    a = F.pad(A.float()[None, None, :] * dt.float(), (0, 0, 0, pad))
    B = F.pad(B.float().repeat_interleave(heads_per_group, dim=2), (0, 0, 0, 0, 0, pad))
    C = F.pad(C.float().repeat_interleave(heads_per_group, dim=2), (0, 0, 0, 0, 0, pad))
    x, a, B, C = (_to_chunks(t, chunk_size) for t in (x, a, B, C))

    a = a.permute(0, 3, 1, 2)  # [b, h, c, l]
    a_cumsum = torch.cumsum(a, dim=-1)

    # 1. Within each chunk (the "diagonal blocks"): attention-like quadratic form.
    decay_within = torch.exp(_segment_sum(a))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores * decay_within.permute(0, 2, 3, 4, 1), x)

    # 2. State contributed by each chunk, decayed to the chunk's end.
    decay_to_end = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_to_end, x)

    # 3. Carry states across chunks, starting from the sequence's existing state.
    chunk_states = torch.cat([initial_state[:, None].float(), chunk_states], dim=1)
    decay_across = torch.exp(_segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0))))  # [b, h, c+1, c+1]
    carried = torch.einsum("bhzc,bchpn->bzhpn", decay_across, chunk_states)
    states_in, final_state = carried[:, :-1], carried[:, -1]

    # 4. Contribution of each chunk's incoming state to its outputs.
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states_in, torch.exp(a_cumsum))

    y = (y_diag + y_off).reshape(b, -1, h, x.shape[-1])[:, :length]
    return y, final_state


def recurrent_step(
    state: torch.Tensor,  # [b, h, p, n], updated in place
    x: torch.Tensor,  # [b, h, p]
    dt: torch.Tensor,  # [b, h], after softplus and clamping
    A: torch.Tensor,  # [h]
    B: torch.Tensor,  # [b, g, n]
    C: torch.Tensor,  # [b, g, n]
) -> torch.Tensor:
    """One token of the recurrence; returns y [b, h, p] (without the D skip term).

    state <- exp(dt * A) * state + (dt * x) outer B, then y = state . C; the outer product is
    accumulated by a batched matmul into the state, never materialised.
    """
    b, h, p, n = state.shape
    heads_per_group = h // B.shape[1]
    B = B.repeat_interleave(heads_per_group, dim=1)  # [b, h, n]
    C = C.repeat_interleave(heads_per_group, dim=1)
    decay = torch.exp(dt * A[None, :])  # [b, h]
    state.mul_(decay[:, :, None, None])
    flat = state.view(b * h, p, n)
    flat.baddbmm_((dt[:, :, None] * x).reshape(b * h, p, 1), B.reshape(b * h, 1, n))
    return torch.bmm(flat, C.reshape(b * h, n, 1)).view(b, h, p)


def chunked_scan_grouped(
    x: torch.Tensor,  # [b, l, h, p]
    dt: torch.Tensor,  # [b, l, h]
    A: torch.Tensor,  # [h]
    B: torch.Tensor,  # [b, l, g, n]
    C: torch.Tensor,  # [b, l, g, n]
    chunk_size: int,
    initial_state: torch.Tensor,  # [b, h, p, n]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_scan` with the same four steps, laid out for batched matmuls (the fast path).

    The heads sharing a group of B/C (h = g * j) are never expanded: C.B scores are made once
    per group, and the state-sized contractions fold (j, p) into one matmul dimension, so
    every einsum becomes a plain batched matmul over [b, c, g] without permuted copies of B/C.

        x  [b, c, l, g, j, p] ─┬─> per head   [b, c, g, j, s, p]  (diagonal blocks)
                               └─> per group  [b, c, g, l, j*p]   (chunk states, outputs)
    """
    b, length, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    j = h // g
    pad = (chunk_size - length % chunk_size) % chunk_size
    xdt = x.float() * dt[..., None].float()
    a = A.float()[None, None, :] * dt.float()  # [b, L, h]
    B, C = B.float(), C.float()
    if pad:
        xdt, a = F.pad(xdt, (0, 0, 0, 0, 0, pad)), F.pad(a, (0, 0, 0, pad))
        B, C = F.pad(B, (0, 0, 0, 0, 0, pad)), F.pad(C, (0, 0, 0, 0, 0, pad))
    c, l = (length + pad) // chunk_size, chunk_size

    a = a.view(b, c, l, h).permute(0, 3, 1, 2)  # [b, h, c, l]
    a_cumsum = torch.cumsum(a, dim=-1)
    Cg = C.view(b, c, l, g, n).permute(0, 1, 3, 2, 4).contiguous()  # [b, c, g, l, n]
    Bg = B.view(b, c, l, g, n).permute(0, 1, 3, 2, 4).contiguous()  # [b, c, g, s, n]
    x6 = xdt.view(b, c, l, g, j, p)

    def per_head(t: torch.Tensor) -> torch.Tensor:
        """[b, h, c, ...] -> [b, c, g, j, ...]"""
        return t.view(b, g, j, c, *t.shape[3:]).movedim(3, 1)

    # 1. Diagonal blocks: (C.B per group) * decay per head, times x.
    scores = Cg @ Bg.transpose(-1, -2)  # [b, c, g, l, s]
    weights = scores[:, :, :, None] * per_head(torch.exp(_segment_sum(a)))  # [b, c, g, j, l, s]
    y_diag = weights @ x6.permute(0, 1, 3, 4, 2, 5)  # [b, c, g, j, l, p]

    # 2. Each chunk's state, decayed to the chunk's end: [b, c, g, j*p, n].
    decay_to_end = per_head(torch.exp(a_cumsum[..., -1:] - a_cumsum))  # [b, c, g, j, l]
    xw = (x6.permute(0, 1, 3, 2, 4, 5) * decay_to_end.permute(0, 1, 2, 4, 3)[..., None]).reshape(b, c, g, l, j * p)
    states = xw.transpose(-1, -2) @ Bg  # [b, c, g, j*p, n]

    # 3. Carry states across chunks from the sequence's state (as the reference, [b, c+1, h, p, n]).
    states = torch.cat([initial_state.float().reshape(b, 1, h, p, n), states.view(b, c, h, p, n)], dim=1)
    decay_across = torch.exp(_segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0))))  # [b, h, c+1, c+1]
    carried = torch.einsum("bhzc,bchpn->bzhpn", decay_across, states)
    states_in, final_state = carried[:, :-1], carried[:, -1]

    # 4. Each chunk's incoming state read by C, decayed to each position.
    y_off = Cg @ states_in.reshape(b, c, g, j * p, n).transpose(-1, -2)  # [b, c, g, l, j*p]
    y_off = y_off.view(b, c, g, l, j, p) * per_head(torch.exp(a_cumsum)).permute(0, 1, 2, 4, 3)[..., None]

    y = (y_diag.permute(0, 1, 4, 2, 3, 5) + y_off.permute(0, 1, 3, 2, 4, 5)).reshape(b, c * l, h, p)
    return y[:, :length], final_state


def recurrent_scan(
    kernel: ModuleType,  # `extensions.scan_kernels()`, built by the runner at start-up
    x: torch.Tensor,  # [b, l, h, p]
    dt: torch.Tensor,  # [b, l, h], after softplus and clamping (0 on padding)
    A: torch.Tensor,  # [h]
    B: torch.Tensor,  # [b, l, g, n]
    C: torch.Tensor,  # [b, l, g, n]
    initial_state: torch.Tensor,  # [b, h, p, n]
    lengths: torch.Tensor | None = None,  # [b] real tokens per row (the rest padded with dt = 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_scan`'s result computed as the recurrence, token by token, in the C++ kernel
    (`csrc/ssd_scan.cpp`: on a CPU the per-head state stays in cache, so this beats SSD's
    matmuls and decay matrices); each row stops at its length, and y is 0 past it. Without
    the kernel (no compiler here) the mixer runs `chunked_scan_grouped` instead, which runs
    the padding, whose dt = 0 leaves the state unchanged."""
    if lengths is None:
        lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
    return kernel.recurrent_scan(*(t.float().contiguous() for t in (x, dt, A, B, C, initial_state)), lengths)
