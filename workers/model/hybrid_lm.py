"""The hybrid language model: embeddings, a stack of blocks, final norm, LM head.

    Bamba / Granite block:   h += r * mixer(norm(h));  h += r * mlp(ffn_norm(h))   (r = residual multiplier)
    Nemotron-H block:        h += mixer(norm(h))       (mixer = Mamba2 | attention | MLP | MoE)

Granite 4.0-H MoE checkpoints have an MoE (routed experts + shared expert) as every layer's mlp.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.kernels.fast_path import FastPath
from workers.kernels.linear_plan import LinearPlan
from workers.kernels.tuned_linear import install_tuned_linears, remove_tuned_linears
from workers.model.attention import Attention
from workers.model.config import BlockSpec, HybridModelConfig, MixerKind
from workers.model.decode_program import DecodeProgram
from workers.model.device import shape_stable_kernels
from workers.model.forward_batch import ForwardBatch, ModelCaches
from workers.model.layers import MLP, RMSNorm, RotaryEmbedding
from workers.model.mamba_mixer import MambaMixer
from workers.model.moe import MoE


class Block(nn.Module):
    def __init__(self, config: HybridModelConfig, spec: BlockSpec, cache_index: int):
        super().__init__()
        self.kind = spec.mixer
        self.cache_index = cache_index  # index into ModelCaches.kv or .conv/.ssm
        self.residual_multiplier = config.residual_multiplier
        hidden = config.hidden_size
        self.norm = RMSNorm(hidden, config.norm_eps)
        if spec.mixer is MixerKind.MAMBA:
            self.mixer = MambaMixer(hidden, config.mamba, config.norm_eps)
        elif spec.mixer is MixerKind.ATTENTION:
            self.mixer = Attention(hidden, config.attention)
        elif spec.mixer is MixerKind.MOE:
            self.mixer = MoE(config.mlp_kind, hidden, config.moe, config.mlp_bias)
        else:
            self.mixer = MLP(config.mlp_kind, hidden, config.mlp_intermediate, config.mlp_bias)
        self.ffn_norm = RMSNorm(hidden, config.norm_eps) if spec.has_ffn else None
        self.ffn: MLP | MoE | None = None
        if spec.ffn_moe:
            self.ffn = MoE(config.mlp_kind, hidden, config.moe, config.mlp_bias)
        elif spec.has_ffn:
            self.ffn = MLP(config.mlp_kind, hidden, config.mlp_intermediate, config.mlp_bias)

    def forward(self, h, x, batch: ForwardBatch, caches: ModelCaches, rope, next_norm: RMSNorm):
        """(h, norm(h)) in, (h', next_norm(h')) out: each residual add and the norm after it run
        as one step (`RMSNorm.residual`), the next block's input norm included."""
        if self.kind is MixerKind.MAMBA:
            x = self.mixer(x, batch, caches.conv[self.cache_index], caches.ssm[self.cache_index])
        elif self.kind is MixerKind.ATTENTION:
            x = self.mixer(x, batch, caches.kv[self.cache_index], rope)
        else:
            x = self.mixer(x)
        if self.ffn is not None:
            h, x = self.ffn_norm.residual(h, x, self.residual_multiplier)
            x = self.ffn(x)
        return next_norm.residual(h, x, self.residual_multiplier)


class HybridLM(nn.Module):
    def __init__(self, config: HybridModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        attn_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        mamba_index = {layer: i for i, layer in enumerate(config.mamba_layers)}
        self.blocks = nn.ModuleList(
            Block(config, spec, attn_index.get(i, mamba_index.get(i, -1))) for i, spec in enumerate(config.blocks)
        )
        self.final_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The norm after each block: the next block's input norm, the final norm after the last.
        self.next_norms = tuple(b.norm for b in self.blocks[1:]) + (self.final_norm,)
        attn = config.attention
        self.rotary = RotaryEmbedding(attn.rotary_dim, attn.rope_theta) if attn.rotary_dim else None
        self._decode_program: DecodeProgram | None = None
        self._decode_program_built = False  # built at the first pure decode step (weights loaded by then)

    def use_fast_path(self, fast: FastPath) -> None:
        """Run what `fast` holds (`workers.kernels.fast_path`), or, with `fast_path.REFERENCE`, the
        pure-torch reference path everywhere."""
        for module in self.modules():
            if hasattr(module, "fast"):
                module.fast = fast
        self._drop_decode_program()

    def use_linear_plan(self, plan: LinearPlan | None) -> None:
        """Run the blocks' weight matmuls on the plan's measured backends
        (`workers.kernels.linear_tuning`, `tuned_linear`), or, with None, on plain `F.linear` everywhere (the
        reference). The LM head is not one of them: `compute_logits` multiplies its weight
        (or the tied embedding) directly, once per sampled row."""
        remove_tuned_linears(self.blocks)
        if plan is not None:
            install_tuned_linears(self.blocks, plan)
        self._drop_decode_program()

    def _drop_decode_program(self) -> None:
        self._decode_program, self._decode_program_built = None, False

    def decode_program(self) -> DecodeProgram | None:
        """The pure decode step of the current fast path and linear plan as one loop
        (`workers.model.decode_program`), or None where only the modules can run it."""
        if not self._decode_program_built:
            self._decode_program, self._decode_program_built = DecodeProgram.build(self), True
        return self._decode_program

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states after the final norm, one row per token of the flat batch. A pure
        decode step on the fused kernels runs the decode program; anything else the modules."""
        if batch.pure_decode:
            program = self.decode_program()
            if program is not None and program.accepts(batch, caches):
                return program.run(batch, caches)
        return self.forward_layers(batch, caches)

    def forward_layers(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """`forward` through the modules, whatever the batch: the decode program's reference."""
        h = self.embed(batch.input_ids)
        if self.config.embedding_multiplier != 1.0:
            h = h * self.config.embedding_multiplier
        rope = self.rotary.cos_sin(batch.positions, h.dtype) if self.rotary else None
        x = self.blocks[0].norm(h)
        with shape_stable_kernels(h.device):
            for block, next_norm in zip(self.blocks, self.next_norms):
                h, x = block(h, x, batch, caches, rope, next_norm)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = hidden @ weight.t()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits
