"""Mamba2's state-space duality (SSD) scan: chunked for prompts, recurrent for decode.

A minimal, readable formulation after the SSD reference (state-spaces/mamba,
`ssd_minimal.py`), extended to start from an existing state so that a chunked
prefill, a cache hit and a fresh prompt all run the same function.

Shapes: b = sequences, l = tokens, h = heads, p = head dim, g = groups, n = state size.
"""

from __future__ import annotations

import functools

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
