"""The fast path's pure decode step as one flat loop over steps resolved once (no module calls).

A decode step at 8-32 rows spends ~20 ms in kernels and weight matmuls; walking the modules
to reach them (`nn.Module.__call__` ~115 times, the fast-path and dtype branches of each
forward, the bucket lookup of 64 linears, attribute chains) cost another ~2 ms of Python.
The program calls the same kernels in the same order on the same tensors, so its output has
the same bits as the module forward (`HybridLM.forward_layers`, kept as its reference and
still run for everything that is not a pure fp32 decode step on the fused kernels):

    built (first pure decode step after use_fast_path / use_linear_plan; weights loaded by then):
      linears[bucket][i]  every block linear's (fn, args) for that row bucket (TunedLinear.bound)
      blocks              per block: its mixer's step (linear indices, cache index, the module's
                          own parameters and Mamba constants), its FFN, the next norm's weight
    each step:
      linears = linears[bucket_index(rows)]            one lookup for all 64 linears
      h = embed(ids) [* m];  x = norm_0(h)
      per block:  x = mixer(x)                          mamba_decode | paged attention | MLP | MoE
                  [h, x = h + a*x, ffn_norm(h);  x = down(act(up(x))) or MoE(x)]
                  h, x = h + a*x, next_norm(h)          add_rms_norm, h in place

A mixture of experts (`workers.model.moe`) runs as its module's forward: its routing decides
per step which expert matrices a row needs, so there is nothing to resolve ahead of it.

The program holds references to the modules' parameters and packed weights, never copies, so
it reads what the modules hold; switching the fast path or the linear plan (`HybridLM.use_*`)
drops it and the next decode step builds another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.linear_backends import BoundLinear
from workers.kernels.tuned_linear import TunedLinear
from workers.model.config import HybridModelConfig, MixerKind, MlpKind
from workers.model.forward_batch import ForwardBatch, ModelCaches
from workers.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from workers.model.moe import MoE


class DecodeModel(Protocol):
    """What a program is built from: the model (`HybridLM`, which builds and runs the program,
    so this module names what it reads instead of importing it)."""

    config: HybridModelConfig
    embed: nn.Embedding
    rotary: RotaryEmbedding | None
    blocks: nn.ModuleList
    next_norms: tuple[RMSNorm, ...]  # the norm after each block: the next block's input norm, then the final norm

    def parameters(self) -> Iterator[nn.Parameter]: ...


class _Mamba(NamedTuple):
    in_proj: int  # index into the step's linears
    out_proj: int
    cache: int  # index into ModelCaches.conv / .ssm
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor
    dt_bias: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    dt_min: float
    dt_max: float
    norm_weight: torch.Tensor
    norm_group: int
    norm_eps: float


class _Attention(NamedTuple):
    qkv: int
    o_proj: int
    cache: int  # index into ModelCaches.kv
    split: list[int]  # q | k | v widths of the qkv output
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float


class _Mlp(NamedTuple):
    up: int
    down: int
    gated: bool  # SwiGLU (else squared ReLU)


class _Moe(NamedTuple):
    module: MoE  # called as is: routing, the experts hit, the shared expert


class _Block(NamedTuple):
    kind: MixerKind
    mixer: _Mamba | _Attention | _Mlp | _Moe
    ffn: _Mlp | _Moe | None
    ffn_norm: torch.Tensor | None
    ffn_eps: float
    next_norm: torch.Tensor  # the next block's input norm, the final norm after the last block
    next_eps: float
    alpha: float  # residual multiplier


class DecodeProgram:
    def __init__(
        self,
        kernels: ModuleType,
        linears: tuple[tuple[BoundLinear, ...], ...],
        bucket_index: Callable[[int], int],
        blocks: tuple[_Block, ...],
        model: DecodeModel,
    ):
        self._kernels = kernels
        self._linears = linears
        self._bucket_index = bucket_index
        self._blocks = blocks
        self._embed = model.embed.weight
        self._embed_multiplier = model.config.embedding_multiplier
        self._rotary = model.rotary
        first = model.blocks[0].norm
        self._first_norm, self._first_eps = first.weight, first.eps
        self._checked_caches: ModelCaches | None = None

    @staticmethod
    def build(model: DecodeModel) -> DecodeProgram | None:
        """The program of `model`'s current fast path and linear plan, or None where the module
        forward must run: no decode kernels (reference path, or no compiler here), or weights
        other than fp32 (the fused kernels are fp32 only)."""
        kernels = model.blocks[0].norm.fast.decode
        if kernels is None or any(p.dtype != torch.float32 for p in model.parameters()):
            return None
        bound: list[tuple[BoundLinear, ...]] = []  # per linear, per bucket
        tunings = set()

        def linear(module: nn.Linear) -> int:
            if isinstance(module, TunedLinear):
                tunings.add(module.tuning)
                bound.append(module.bound)
            else:
                bound.append(((F.linear, (module.weight, module.bias)),))
            return len(bound) - 1

        def mlp(module) -> _Mlp | _Moe:
            if isinstance(module, MoE):
                return _Moe(module)
            return _Mlp(linear(module.up), linear(module.down), module.kind is MlpKind.SWIGLU)

        blocks = []
        for block, next_norm in zip(model.blocks, model.next_norms):
            m = block.mixer
            if block.kind is MixerKind.MAMBA:
                s, c = m.shape, m.constants
                mixer = _Mamba(
                    linear(m.in_proj), linear(m.out_proj), block.cache_index,
                    c.conv_weight, c.kernel_conv_bias, c.dt_bias, c.A, c.D,
                    s.dt_min, s.dt_max, m.norm.weight, m.norm.group_size, m.norm.eps,
                )  # fmt: skip
            elif block.kind is MixerKind.ATTENTION:
                s = m.shape
                q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
                mixer = _Attention(
                    linear(m.qkv), linear(m.o_proj), block.cache_index, [q, kv, kv],
                    s.n_heads, s.n_kv_heads, s.head_dim, s.scale,
                )  # fmt: skip
            else:
                mixer = mlp(m)
            ffn = mlp(block.ffn) if block.ffn is not None else None
            ffn_norm = block.ffn_norm.weight if block.ffn_norm is not None else None
            ffn_eps = block.ffn_norm.eps if block.ffn_norm is not None else 0.0
            blocks.append(
                _Block(block.kind, mixer, ffn, ffn_norm, ffn_eps, next_norm.weight, next_norm.eps, block.residual_multiplier)
            )
        if len(tunings) > 1:  # install_tuned_linears gives all one plan's tuning
            raise ValueError("the block linears follow different tunings")
        tuning = tunings.pop() if tunings else None
        buckets = len(tuning.buckets) if tuning is not None else 1
        # A plain linear has one entry: the same for every bucket.
        linears = tuple(tuple(b[i] if len(b) > 1 else b[0] for b in bound) for i in range(buckets))
        bucket_index = tuning.bucket_index if tuning is not None else _first_bucket
        return DecodeProgram(kernels, linears, bucket_index, tuple(blocks), model)

    def accepts(self, batch: ForwardBatch, caches: ModelCaches) -> bool:
        """A pure decode step (rows = the group's sequences in order) over fp32 K/V caches (the
        paged attention kernel's); anything else runs the module forward."""
        if not batch.pure_decode:
            return False
        if caches is not self._checked_caches:
            if any(kv.dtype != torch.float32 for kv in caches.kv):
                return False
            self._checked_caches = caches
        return True

    def run(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states after the final norm, one row per sequence: `forward_layers`' bits."""
        k = self._kernels
        add_rms_norm, mlp_activation = k.add_rms_norm, k.mlp_activation
        mamba_decode, attend = k.mamba_decode, k.paged_decode_attention
        group = batch.decode
        n = batch.input_ids.shape[0]
        linears = self._linears[self._bucket_index(n)]
        slots, tables, num_keys, kv_slots = group.state_slots, group.block_tables, group.num_keys, batch.kv_slots
        snapshot = group.snapshot_rows is not None
        if snapshot:
            snapshot_src, snapshot_dst = slots[group.snapshot_rows], group.snapshot_slots
        conv_caches, ssm_caches, kv_caches = caches.conv, caches.ssm, caches.kv

        h = F.embedding(batch.input_ids, self._embed)
        if self._embed_multiplier != 1.0:
            h = h * self._embed_multiplier
        rope = self._rotary.cos_sin(batch.positions, h.dtype) if self._rotary is not None else None
        x = k.rms_norm(h, self._first_norm, None, h.shape[-1], self._first_eps)
        for kind, mixer, ffn, ffn_norm, ffn_eps, next_norm, next_eps, alpha in self._blocks:
            if kind is MixerKind.MAMBA:
                fn, args = linears[mixer.in_proj]
                zxbcdt = fn(x, *args)
                conv, ssm = conv_caches[mixer.cache], ssm_caches[mixer.cache]
                y = mamba_decode(
                    zxbcdt, conv, ssm, slots, mixer.conv_weight, mixer.conv_bias, mixer.dt_bias, mixer.A, mixer.D,
                    mixer.dt_min, mixer.dt_max, mixer.norm_weight, mixer.norm_group, mixer.norm_eps,
                )  # fmt: skip
                if snapshot:
                    conv[snapshot_dst] = conv[snapshot_src]
                    ssm[snapshot_dst] = ssm[snapshot_src]
                fn, args = linears[mixer.out_proj]
                x = fn(y, *args)
            elif kind is MixerKind.ATTENTION:
                fn, args = linears[mixer.qkv]
                q, key, value = fn(x, *args).split(mixer.split, -1)
                q = q.view(n, mixer.n_heads, mixer.head_dim)
                key = key.view(n, mixer.n_kv_heads, mixer.head_dim)
                value = value.view(n, mixer.n_kv_heads, mixer.head_dim)
                if rope is not None:
                    q, key = apply_rotary(q, *rope), apply_rotary(key, *rope)
                kv = kv_caches[mixer.cache]
                out = attend(q, kv[0], kv[1], tables, num_keys, mixer.scale, key, value, kv_slots)
                fn, args = linears[mixer.o_proj]
                x = fn(out.reshape(n, -1), *args)
            else:
                x = _mlp(x, mixer, linears, mlp_activation)
            if ffn is not None:
                x = add_rms_norm(h, x, alpha, ffn_norm, ffn_eps)
                x = _mlp(x, ffn, linears, mlp_activation)
            x = add_rms_norm(h, x, alpha, next_norm, next_eps)
        return x


def _mlp(x: torch.Tensor, mlp: _Mlp | _Moe, linears: tuple[BoundLinear, ...], activation) -> torch.Tensor:
    if type(mlp) is _Moe:
        return mlp.module(x)
    fn, args = linears[mlp.up]
    up = fn(x, *args)
    fn, args = linears[mlp.down]
    return fn(activation(up, mlp.gated), *args)


def _first_bucket(rows: int) -> int:
    return 0
