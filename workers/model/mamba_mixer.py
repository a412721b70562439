"""Mamba2 mixer over a flat batch: prompt runs use the chunked scan, decodes the recurrence.

Every sequence starts from the conv and SSM state in its slot and leaves its new state there,
so a chunk of a long prompt, a cache hit and a fresh prompt all run the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.config import MambaShape
from workers.model.forward_batch import ForwardBatch
from workers.model.layers import GatedGroupRMSNorm
from workers.model.ssd import chunked_scan, recurrent_step


class MambaMixer(nn.Module):
    def __init__(self, hidden: int, shape: MambaShape, eps: float):
        super().__init__()
        self.shape = shape
        self.in_proj = nn.Linear(hidden, shape.in_proj_dim, bias=shape.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(shape.conv_dim, shape.d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(shape.conv_dim)) if shape.conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(shape.n_heads))
        self.A_log = nn.Parameter(torch.zeros(shape.n_heads))
        self.D = nn.Parameter(torch.ones(shape.n_heads))
        self.norm = GatedGroupRMSNorm(shape.intermediate, shape.n_groups, eps)
        self.out_proj = nn.Linear(shape.intermediate, hidden, bias=shape.proj_bias)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        s = self.shape
        gate, xbc, dt = self.in_proj(h).split([s.intermediate, s.conv_dim, s.n_heads], dim=-1)
        y = torch.empty(h.shape[0], s.intermediate, dtype=h.dtype, device=h.device)
        for seg in batch.prefills:
            rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
            y[rows] = self._prefill(xbc[rows], dt[rows], conv, ssm, seg.state_slot)
            if seg.snapshot_slot is not None:
                conv[seg.snapshot_slot] = conv[seg.state_slot]
                ssm[seg.snapshot_slot] = ssm[seg.state_slot]
        group = batch.decode
        if group is not None:
            rows = group.token_index
            y[rows] = self._decode(xbc[rows], dt[rows], conv, ssm, group)
            if group.snapshot_rows is not None:
                src = group.state_slots[group.snapshot_rows]
                conv[group.snapshot_slots] = conv[src]
                ssm[group.snapshot_slots] = ssm[src]
        return self.out_proj(self.norm(y, gate))

    def _time_step(self, dt: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt + self.dt_bias)
        return dt.clamp(min=self.shape.dt_min, max=self.shape.dt_max)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        gn = s.n_groups * s.d_state
        return xbc.split([s.intermediate, gn, gn], dim=-1)

    def _prefill(self, xbc, dt, conv, ssm, slot: int) -> torch.Tensor:
        s = self.shape
        length = xbc.shape[0]
        # Causal depthwise conv over [cached d_conv-1 inputs | this run's inputs].
        window = torch.cat([conv[slot], xbc.t()], dim=1)  # [conv_dim, d_conv - 1 + length]
        conv[slot].copy_(window[:, -(s.d_conv - 1) :])
        xbc = F.silu(F.conv1d(window[None], self.conv_weight[:, None, :], self.conv_bias, groups=s.conv_dim)[0].t())
        x, B, C = self._split_xbc(xbc)
        x = x.reshape(1, length, s.n_heads, s.head_dim)
        y, final = chunked_scan(
            x,
            self._time_step(dt)[None],
            -torch.exp(self.A_log.float()),
            B.reshape(1, length, s.n_groups, s.d_state),
            C.reshape(1, length, s.n_groups, s.d_state),
            s.chunk_size,
            ssm[slot][None],
        )
        ssm[slot].copy_(final[0])
        y = y[0] + x[0] * self.D[:, None]
        return y.reshape(length, s.intermediate).to(xbc.dtype)

    def _decode(self, xbc, dt, conv, ssm, group) -> torch.Tensor:
        s = self.shape
        batch = xbc.shape[0]
        if group.slot_run is not None:  # views: the recurrence updates the slots in place
            run = slice(group.slot_run, group.slot_run + batch)
            conv_state, state = conv[run], ssm[run]
        else:
            conv_state, state = conv[group.state_slots], ssm[group.state_slots]
        window = torch.cat([conv_state, xbc[:, :, None]], dim=2)  # [B, conv_dim, d_conv]
        conv_state.copy_(window[:, :, 1:])
        xbc = F.silu((window * self.conv_weight[None]).sum(-1) + (0 if self.conv_bias is None else self.conv_bias))
        x, B, C = self._split_xbc(xbc)
        x = x.reshape(batch, s.n_heads, s.head_dim)
        y = recurrent_step(
            state,
            x,
            self._time_step(dt),
            -torch.exp(self.A_log.float()),
            B.reshape(batch, s.n_groups, s.d_state),
            C.reshape(batch, s.n_groups, s.d_state),
        )
        if group.slot_run is None:
            conv[group.state_slots] = conv_state
            ssm[group.state_slots] = state
        y = y + x * self.D[:, None]
        return y.reshape(batch, s.intermediate)
