r"""Mamba2 inside a tile: a fixed-chunk SSD scan for the outputs, and the exact state at any
position of the tile rebuilt from the scan's per-position inputs.

    tile:       kT ......... p ............ (k+1)T
    inputs:     s0 = state at kT (the aligned state),  per position s: dA_s = A dt_s,
                xdt_s = x_s dt_s,  B_s;   conv window = [last d_conv-1 inputs before kT | tile inputs]
    state(p):   exp(sum_{s<p} dA_s) s0 + sum_{s<p} exp(sum_{s<i<p} dA_i) xdt_s (x) B_s

`state_at` computes state(p) for one p per row with the whole tile's shape: positions >= p
are masked to exact zeros (dA = 0, xdt = 0), so a state at p has the same bits whichever
tokens follow p and whether the tile was full. Keeping these inputs (a few hundred KB per
layer) instead of a full state per position (~6 MB each on the bench model) is what makes
rollback to any position cheap. Every committed state of a deterministic request (tile end,
accepted position, end of request) comes from this one function.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ScanInputs:
    """What a Mamba layer of a verify pass keeps for rebuilding states inside the tile."""

    window: torch.Tensor  # [G, conv_dim, d_conv - 1 + T]: cached conv inputs, then the tile's
    dA: torch.Tensor  # [G, T, H] float32
    xdt: torch.Tensor  # [G, T, H, P] float32
    B: torch.Tensor  # [G, T, H, N] float32 (groups expanded to heads)
    s0: torch.Tensor  # [G, H, P, N] float32


@functools.lru_cache(maxsize=8)
def _masks(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=device), diagonal=-1)
    on_or_below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=device), diagonal=0)
    return below, on_or_below


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, -inf above the diagonal."""
    size = x.size(-1)
    below, on_or_below = _masks(size, x.device)
    x = x[..., None].expand(*x.size(), size).masked_fill(~below, 0)
    return torch.cumsum(x, dim=-2).masked_fill(~on_or_below, -torch.inf)


def tile_scan(inputs: ScanInputs, C: torch.Tensor, chunk: int) -> torch.Tensor:
    """y [G, T, H, P] (without the D skip) for every position of the tile, from s0."""
    g, t, h, p = inputs.xdt.shape
    c = t // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(g, c, chunk, *x.shape[2:])

    x, B, C = chunks(inputs.xdt), chunks(inputs.B), chunks(C)
    a = chunks(inputs.dA).permute(0, 3, 1, 2)  # [G, H, c, l]
    a_cumsum = torch.cumsum(a, dim=-1)
    decay_within = torch.exp(_segment_sum(a))
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores * decay_within.permute(0, 2, 3, 4, 1), x)
    decay_to_end = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_to_end, x)
    chunk_states = torch.cat([inputs.s0[:, None], chunk_states], dim=1)
    decay_across = torch.exp(_segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0))))
    states_in = torch.einsum("bhzc,bchpn->bzhpn", decay_across, chunk_states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states_in, torch.exp(a_cumsum))
    return (y_diag + y_off).reshape(g, t, h, p)


def state_at(inputs: ScanInputs, lengths: torch.Tensor, d_conv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv state [G, conv_dim, d_conv-1], SSM state [G, H, P, N]) after the first
    `lengths[r]` tokens of row r's tile (0 <= lengths[r] <= T).

        window:  [ c c c | t0 t1 t2 ... ]      conv state after n tokens = window[:, n : n + d_conv - 1]
    """
    g, t = inputs.dA.shape[:2]
    keep = torch.arange(t, device=lengths.device)[None, :] < lengths[:, None]  # [G, T]
    dA = torch.where(keep[:, :, None], inputs.dA, 0.0)
    xdt = torch.where(keep[:, :, None, None], inputs.xdt, 0.0)
    cum = torch.cumsum(dA, dim=1)  # [G, T, H]
    total = cum[:, -1]  # [G, H] = sum over the kept positions
    decay = torch.exp(total[:, None] - cum)  # [G, T, H]
    ssm = torch.exp(total)[:, :, None, None] * inputs.s0 + torch.einsum("gthn,gth,gthp->ghpn", inputs.B, decay, xdt)
    offsets = lengths[:, None] + torch.arange(d_conv - 1, device=lengths.device)[None, :]  # [G, d_conv-1]
    conv = inputs.window.gather(2, offsets[:, None, :].expand(g, inputs.window.shape[1], -1))
    return conv, ssm
