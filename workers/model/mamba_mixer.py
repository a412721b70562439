"""Mamba2 mixer over a flat batch: prompt runs use the chunked scan, decodes the recurrence.

Every sequence starts from the conv and SSM state in its slot and leaves its new state there,
so a chunk of a long prompt, a cache hit and a fresh prompt all run the same code; a fresh
prompt's first segment (context_len 0) starts from zeros instead and never reads its slot, so
a new sequence's slot needs no zeroing first.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.fast_path import REFERENCE, FastPath
from workers.model.config import MambaShape
from workers.model.forward_batch import ForwardBatch, PrefillSegment
from workers.model.layers import GatedGroupRMSNorm
from workers.model.ssd import chunked_scan, chunked_scan_grouped, recurrent_scan, recurrent_step


class MambaConstants(NamedTuple):
    """The mixer's small parameters in fp32, made once: the conv and the scan run in fp32
    whatever the weights' dtype, because the conv and SSM states they extend are fp32."""

    A: torch.Tensor  # -exp(A_log), [h]
    conv_weight: torch.Tensor  # [conv_dim, d_conv]
    conv_bias: torch.Tensor | None  # [conv_dim]
    dt_bias: torch.Tensor  # [h]
    D: torch.Tensor  # [h]

    @property
    def kernel_conv_bias(self) -> torch.Tensor:
        """conv_bias as the C++ kernels take it: an empty tensor for none."""
        return self.conv_bias if self.conv_bias is not None else _EMPTY


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
        self._constants: MambaConstants | None = None
        self.fast: FastPath = REFERENCE

    @property
    def constants(self) -> MambaConstants:
        """Made on first use (the parameters are loaded after construction) and then kept."""
        if self._constants is None:
            self._constants = MambaConstants(
                A=-torch.exp(self.A_log.detach().float()),
                conv_weight=self.conv_weight.detach().float(),
                conv_bias=None if self.conv_bias is None else self.conv_bias.detach().float(),
                dt_bias=self.dt_bias.detach().float(),
                D=self.D.detach().float(),
            )
        return self._constants

    def forward(self, h: torch.Tensor, batch: ForwardBatch, conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        s = self.shape
        zxbcdt = self.in_proj(h)  # | gate | xBC | dt |
        group = batch.decode
        fused = self.fast.decode is not None
        if batch.pure_decode and fused and zxbcdt.dtype == torch.float32:
            # A pure decode step in fp32: conv, recurrence and the gated norm in one kernel.
            y = self._decode_fused(zxbcdt, conv, ssm, group, norm=True)
        else:
            gate = zxbcdt[:, : s.intermediate]
            decode = self._decode_fused if fused else self._decode
            if batch.pure_decode:
                y = decode(zxbcdt, conv, ssm, group).to(h.dtype)
            else:
                y = torch.empty(h.shape[0], s.intermediate, dtype=h.dtype, device=h.device)
                _, xbc, dt = zxbcdt.split([s.intermediate, s.conv_dim, s.n_heads], dim=-1)
                in_place = self.fast.scan is not None and xbc.dtype == conv.dtype == ssm.dtype == torch.float32
                prefill = self._prefill_fused if in_place else self._prefill
                for wave in _waves(batch.prefills):
                    prefill(xbc, dt, conv, ssm, wave, y)
                if group is not None:
                    rows = group.token_index
                    y[rows] = decode(zxbcdt[rows], conv, ssm, group).to(y.dtype)
            y = self.norm(y, gate)
        if group is not None and group.snapshot_rows is not None:
            src = group.state_slots[group.snapshot_rows]
            conv[group.snapshot_slots] = conv[src]
            ssm[group.snapshot_slots] = ssm[src]
        return self.out_proj(y)

    def _time_step(self, dt: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt.float() + self.constants.dt_bias)
        return dt.clamp(min=self.shape.dt_min, max=self.shape.dt_max)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        gn = s.n_groups * s.d_state
        return xbc.split([s.intermediate, gn, gn], dim=-1)

    def _prefill(self, xbc, dt, conv, ssm, segs: list[PrefillSegment], y: torch.Tensor) -> None:
        """All segments of a wave in one padded batch [k, longest, ...].

            seq 0: t t t t t        padding is read by nothing valid (the conv and the scan are
            seq 1: t t . . .        causal) and has dt = 0, so the state passes it unchanged:
            seq 2: t t t t .        each sequence's final state is its state after its last token
        """
        s, c = self.shape, self.constants
        k, longest, device = len(segs), max(seg.num_tokens for seg in segs), xbc.device
        lengths = torch.tensor([seg.num_tokens for seg in segs], device=device)
        steps = torch.arange(longest, device=device)[None, :]
        valid = steps < lengths[:, None]  # [k, longest]
        rows = torch.tensor([seg.token_start for seg in segs], device=device)[:, None] + steps
        rows = torch.where(valid, rows, 0)
        slots = torch.tensor([seg.state_slot for seg in segs], device=device)
        # A sequence's first tokens start from the zero state whatever its slot holds (a fresh
        # slot is not zeroed before the step).
        fresh = torch.tensor([seg.context_len == 0 for seg in segs], device=device)
        conv_in = torch.where(fresh[:, None, None], 0.0, conv[slots])
        ssm_in = torch.where(fresh[:, None, None, None], 0.0, ssm[slots])

        # Causal depthwise conv over [cached d_conv-1 inputs | this run's inputs].
        window = torch.cat([conv_in, xbc[rows].transpose(1, 2).float()], dim=2)  # [k, conv_dim, d_conv-1+longest]
        last = lengths[:, None] + torch.arange(s.d_conv - 1, device=device)[None, :]  # the last d_conv-1 real inputs
        conv[slots] = window.gather(2, last[:, None, :].expand(k, s.conv_dim, -1))
        out = F.silu(F.conv1d(window, c.conv_weight[:, None, :], c.conv_bias, groups=s.conv_dim))
        x, B, C = self._split_xbc(out.transpose(1, 2))
        x = x.reshape(k, longest, s.n_heads, s.head_dim)
        step = torch.where(valid[:, :, None], self._time_step(dt[rows]), 0.0)
        B, C = B.reshape(k, longest, s.n_groups, s.d_state), C.reshape(k, longest, s.n_groups, s.d_state)
        if self.fast.scan is not None:  # the recurrence skips each row's padding; the SSD scans run it
            scan, final = recurrent_scan(self.fast.scan, x, step, c.A, B, C, ssm_in, lengths)
        else:
            ssd_scan = chunked_scan_grouped if self.fast.on else chunked_scan
            scan, final = ssd_scan(x, step, c.A, B, C, _scan_chunk(s.chunk_size, longest), ssm_in)
        ssm[slots] = final.to(ssm.dtype)
        scan = (scan + x * c.D[:, None]).reshape(k, longest, s.intermediate)
        y[rows[valid]] = scan[valid].to(y.dtype)
        for seg in segs:
            for snapshot in seg.snapshot_slots:
                conv[snapshot] = conv[seg.state_slot]
                ssm[snapshot] = ssm[seg.state_slot]

    def _prefill_fused(self, xbc, dt, conv, ssm, segs: list[PrefillSegment], y: torch.Tensor) -> None:
        """`_prefill` in two C++ passes over the flat rows (`csrc/ssd_scan.cpp`): no padded wave.

            flat rows:  [ seg 0: t t t t t | seg 1: t t | seg 2: t t t t ]     (in_proj output, read in place)
            prefill_conv  conv + silu per row from [conv state | rows]; conv state of each slot <- last K-1 inputs
            prefill_scan  recurrence per (segment, head) from the slot's SSM state, in place; y rows = scan + D x

        A fresh segment (a sequence's first tokens) starts both from zero without reading its slot.
        """
        s, c, kernel = self.shape, self.constants, self.fast.scan
        starts = torch.tensor([seg.token_start for seg in segs])
        counts = torch.tensor([seg.num_tokens for seg in segs])
        slots = torch.tensor([seg.state_slot for seg in segs])
        fresh = torch.tensor([seg.context_len == 0 for seg in segs])
        out = kernel.prefill_conv(xbc, conv, starts, counts, slots, c.conv_weight, c.kernel_conv_bias, fresh)
        kernel.prefill_scan(out, dt, c.dt_bias, c.A, c.D, ssm, starts, counts, slots, s.dt_min, s.dt_max, y, fresh)
        for seg in segs:
            for snapshot in seg.snapshot_slots:
                conv[snapshot] = conv[seg.state_slot]
                ssm[snapshot] = ssm[seg.state_slot]

    def _decode_fused(self, zxbcdt, conv, ssm, group, norm: bool = False) -> torch.Tensor:
        """`_decode` in one kernel reading the in_proj rows as they are: conv and recurrence make
        one pass over their states, in place at the sequences' slots (contiguous or not); with
        `norm`, the gated norm too (what `self.norm(y, gate)` returns, in fp32)."""
        s, c = self.shape, self.constants
        return self.fast.decode.mamba_decode(
            zxbcdt.float(), conv, ssm, group.state_slots,
            c.conv_weight, c.kernel_conv_bias, c.dt_bias, c.A, c.D,
            s.dt_min, s.dt_max, self.norm.weight if norm else _EMPTY, self.norm.group_size, self.norm.eps,
        )  # fmt: skip

    def _decode(self, zxbcdt, conv, ssm, group) -> torch.Tensor:
        """Reference decode step (pure torch): y before the gated norm."""
        s, c = self.shape, self.constants
        _, xbc, dt = zxbcdt.split([s.intermediate, s.conv_dim, s.n_heads], dim=-1)
        batch = xbc.shape[0]
        if group.slot_run is not None:  # views: the recurrence updates the slots in place
            run = slice(group.slot_run, group.slot_run + batch)
            conv_state, state = conv[run], ssm[run]
        else:
            conv_state, state = conv[group.state_slots], ssm[group.state_slots]
        window = torch.cat([conv_state, xbc[:, :, None].float()], dim=2)  # [B, conv_dim, d_conv]
        conv_state.copy_(window[:, :, 1:])
        xbc = F.silu((window * c.conv_weight[None]).sum(-1) + (0 if c.conv_bias is None else c.conv_bias))
        x, B, C = self._split_xbc(xbc)
        x = x.reshape(batch, s.n_heads, s.head_dim)
        y = recurrent_step(
            state,
            x,
            self._time_step(dt),
            c.A,
            B.reshape(batch, s.n_groups, s.d_state),
            C.reshape(batch, s.n_groups, s.d_state),
        )
        if group.slot_run is None:
            conv[group.state_slots] = conv_state
            ssm[group.state_slots] = state
        y = y + x * c.D[:, None]
        return y.reshape(batch, s.intermediate)


_EMPTY = torch.empty(0)  # "none" for the kernel's optional tensors (conv bias, norm weight)


def _waves(segments: tuple[PrefillSegment, ...]) -> list[list[PrefillSegment]]:
    """Batches of segments with distinct state slots, in order: a sequence split in two
    (at an aligned snapshot) runs its second segment in the next wave, from the first's state."""
    waves: list[list[PrefillSegment]] = []
    for seg in segments:
        for wave in waves:
            if all(other.state_slot != seg.state_slot for other in wave):
                wave.append(seg)
                break
        else:
            waves.append([seg])
    return waves


def _scan_chunk(chunk_size: int, longest: int) -> int:
    """The checkpoint's chunk size, or less for short runs (a cache hit's suffix, a split at a
    snapshot): the scan is exact for any chunk size, and its intra-chunk work is quadratic in
    it, so padding 20 tokens to a 256-token chunk would cost ~100x what it needs."""
    return min(chunk_size, max(16, 1 << (longest - 1).bit_length()))
