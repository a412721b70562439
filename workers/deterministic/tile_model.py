"""The model over one verify tile, G rows x T tokens, with shapes that never change.

Only the model's weights are reused; the computation is written here so that nothing on
this path depends on the fast path's kernels or on what else is batched:
  - dense layers (projections, MLPs, the LM head) always see G*T rows;
  - a mixture of experts runs every expert on all G*T rows, weighted by the routing weight
    (zero where the row did not choose it), summed in expert order (tile_moe);
  - attention folds key blocks aligned to absolute positions in a fixed order
    (tile_attention), never SDPA with a batch-dependent key length;
  - Mamba uses a fixed SSD chunk from the aligned state at the tile start (tile_ssd).
Padding after a row's valid tokens and dummy rows are ordinary finite inputs: everything is
causal, so they reach valid positions only through exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.deterministic.tile_attention import tile_attention
from workers.deterministic.tile_ssd import ScanInputs, tile_scan
from workers.model.config import MixerKind, MlpKind
from workers.model.device import shape_stable_kernels
from workers.model.forward_batch import ModelCaches
from workers.model.hybrid_lm import HybridLM
from workers.model.layers import apply_rotary
from workers.model.moe import MoE


@dataclass(frozen=True)
class TileBatch:
    input_ids: torch.Tensor  # [G, T] long
    positions: torch.Tensor  # [G, T] long, absolute
    tables: torch.Tensor  # [G, pages] long: the KV pages of each row's history (< tile start)
    history_blocks: torch.Tensor  # [G] long: tile start // T
    conv0: list[torch.Tensor]  # per Mamba layer [G, conv_dim, d_conv-1]: state at the tile start
    ssm0: list[torch.Tensor]  # per Mamba layer [G, H, P, N]


@dataclass(frozen=True)
class TileResult:
    logits: torch.Tensor  # [G, T, vocab] float32
    keys: list[torch.Tensor]  # per attention layer [G, T, kv, d]
    values: list[torch.Tensor]
    scans: list[ScanInputs]  # per Mamba layer


def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.eps).to(x.dtype)


def _mlp(x: torch.Tensor, mlp) -> torch.Tensor:
    if isinstance(mlp, MoE):
        return tile_moe(x, mlp)
    if mlp.kind is MlpKind.SWIGLU:
        gate, up = _linear(x, mlp.up).split(mlp.intermediate, dim=-1)
        return _linear(F.silu(gate) * up, mlp.down)
    return _linear(torch.square(F.relu(_linear(x, mlp.up))), mlp.down)


def tile_moe(x: torch.Tensor, moe: MoE) -> torch.Tensor:
    """`MoE.forward` whose shapes and order of sums never depend on the routing: each row's
    output is a function of that row alone, whatever the other rows chose."""
    weights, index = moe.route(x)
    dense = torch.zeros(x.shape[0], moe.shape.n_experts, dtype=weights.dtype, device=x.device)
    dense.scatter_(1, index, weights)
    out = torch.zeros(x.shape, dtype=weights.dtype, device=x.device)
    for expert in range(moe.shape.n_experts):
        out += moe.expert(x, expert).to(out.dtype) * dense[:, expert, None]
    return out.to(x.dtype) + _mlp(x, moe.shared)


class TileModel:
    def __init__(self, model: HybridLM, caches: ModelCaches, ssd_chunk: int):
        self.model = model
        self.caches = caches
        self.ssd_chunk = ssd_chunk
        self.device = model.embed.weight.device  # the tile's inputs are made there

    @torch.inference_mode()
    def forward(self, batch: TileBatch) -> TileResult:
        model, cfg = self.model, self.model.config
        g, t = batch.input_ids.shape
        h = F.embedding(batch.input_ids.reshape(-1), model.embed.weight)
        if cfg.embedding_multiplier != 1.0:
            h = h * cfg.embedding_multiplier
        rope = model.rotary.cos_sin(batch.positions.reshape(-1), h.dtype) if model.rotary else None
        keys, values, scans = [], [], []
        with shape_stable_kernels(self.device):
            for block in model.blocks:
                x = _rms(h, block.norm)
                if block.kind is MixerKind.MAMBA:
                    x, scan = self._mamba(x, block.mixer, batch, block.cache_index, g, t)
                    scans.append(scan)
                elif block.kind is MixerKind.ATTENTION:
                    x, k, v = self._attention(x, block.mixer, batch, block.cache_index, rope, g, t)
                    keys.append(k)
                    values.append(v)
                else:
                    x = _mlp(x, block.mixer)
                h = h + x * block.residual_multiplier
                if block.ffn is not None:
                    h = h + _mlp(_rms(h, block.ffn_norm), block.ffn) * block.residual_multiplier
        hidden = _rms(h, model.final_norm)
        weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
        logits = F.linear(hidden, weight).float()
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        return TileResult(logits.view(g, t, -1), keys, values, scans)

    def _attention(self, x, attn, batch: TileBatch, index: int, rope, g: int, t: int):
        s = attn.shape
        q, k, v = _linear(x, attn.qkv).split(
            [s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_kv_heads * s.head_dim], -1
        )
        q = q.reshape(g * t, s.n_heads, s.head_dim)
        k = k.reshape(g * t, s.n_kv_heads, s.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        q, k = q.reshape(g, t, s.n_heads, s.head_dim), k.reshape(g, t, s.n_kv_heads, s.head_dim)
        v = v.reshape(g, t, s.n_kv_heads, s.head_dim)
        out = tile_attention(q, k, v, self.caches.kv[index], batch.tables, batch.history_blocks, s.scale)
        return _linear(out.reshape(g * t, -1), attn.o_proj), k, v

    def _mamba(self, x, mixer, batch: TileBatch, index: int, g: int, t: int):
        s = mixer.shape
        gate, xbc, dt = _linear(x, mixer.in_proj).split([s.intermediate, s.conv_dim, s.n_heads], dim=-1)
        # The conv runs in fp32 whatever the weights' dtype, as the mixer's does (its state is fp32).
        c = mixer.constants
        window = torch.cat([batch.conv0[index].float(), xbc.reshape(g, t, s.conv_dim).transpose(1, 2).float()], dim=2)
        conv = F.conv1d(window, c.conv_weight[:, None, :], c.conv_bias, groups=s.conv_dim)
        xs, B, C = F.silu(conv).transpose(1, 2).split([s.intermediate, s.n_groups * s.d_state, s.n_groups * s.d_state], -1)
        step = F.softplus(dt.reshape(g, t, s.n_heads).float() + mixer.dt_bias.float())
        step = step.clamp(min=s.dt_min, max=s.dt_max)
        per_group = s.n_heads // s.n_groups
        xs = xs.reshape(g, t, s.n_heads, s.head_dim)
        scan = ScanInputs(
            window=window.float(),
            dA=-torch.exp(mixer.A_log.float())[None, None, :] * step,
            xdt=xs.float() * step[..., None],
            B=B.reshape(g, t, s.n_groups, s.d_state).float().repeat_interleave(per_group, dim=2),
            s0=batch.ssm0[index].float(),
        )
        C = C.reshape(g, t, s.n_groups, s.d_state).float().repeat_interleave(per_group, dim=2)
        y = tile_scan(scan, C, self.ssd_chunk) + xs.float() * mixer.D.float()[:, None]
        y = y.reshape(g * t, s.intermediate).to(x.dtype)
        return _linear(_gated_norm(y, gate, mixer.norm), mixer.out_proj), scan


def _gated_norm(y: torch.Tensor, gate: torch.Tensor, norm) -> torch.Tensor:
    """Mamba2's output norm: RMSNorm over groups of channels of y * silu(gate)."""
    x32 = y.float() * F.silu(gate.float())
    grouped = F.rms_norm(x32.view(x32.shape[0], -1, norm.group_size), (norm.group_size,), eps=norm.eps)
    return norm.weight * grouped.view(x32.shape).to(y.dtype)
