"""Architecture-neutral shapes of the built-in random checkpoints.

A `ModelShape` describes one model with the Nemotron-H layer alphabet:

    "M"  Mamba2 mixer          "*"  full attention (GQA)          "-"  MLP alone
    "E"  mixture of experts alone (Nemotron-H only)

Bamba and Granite 4.0-H layers are "mixer + MLP", so their patterns use only "M" and
"*" (the MLP comes with every layer); Nemotron-H layers are a single block each, so its
patterns interleave "-" and "E" explicitly. `configs.py` turns a shape into a transformers config.

A shape with `moe` set is a mixture-of-experts model: for Granite 4.0-H every layer's MLP
becomes routed experts plus a shared expert (Granite 4.0-H Tiny / Small); for Nemotron-H the
"E" layers are routed experts plus a shared expert (Nemotron 3 Nano). The MoE presets are a
separate table (`preset_shape(arch, preset, moe=True)`), so the dense ones stay as they were.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum


class Arch(str, Enum):
    BAMBA = "bamba"
    GRANITEMOEHYBRID = "granitemoehybrid"
    NEMOTRON_H = "nemotron_h"


class Preset(str, Enum):
    TINY = "tiny"  # unit tests: loads and runs in milliseconds
    SMALL = "small"  # built-in demo default, ~10M parameters
    BENCH = "bench"  # CPU benchmarks, 30-100M parameters


class PositionEmbedding(str, Enum):
    """Granite 4.0-H only; Bamba and Nemotron-H always use RoPE and no positions, respectively."""

    ROPE = "rope"
    NOPE = "nope"


class LayerKind(str, Enum):
    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"
    MOE = "E"


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    experts_per_token: int  # top-k
    expert_intermediate_size: int
    shared_intermediate_size: int  # the shared expert, run on every token
    # Nemotron-H's routing (sigmoid scores, DeepSeek-V3 style): experts fall into n_group
    # groups, a token picks topk_group groups, then its top-k experts among those; the
    # chosen scores are renormalised (norm_topk_prob) and scaled. Granite ignores these.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError("experts_per_token must be in 1..num_experts")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError("n_group must divide num_experts and topk_group must be in 1..n_group")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("grouped routing scores each group by its top two experts")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    layer_pattern: str
    num_attention_heads: int
    num_key_value_heads: int
    mlp_intermediate_size: int
    mamba_head_dim: int
    mamba_n_groups: int
    mamba_d_state: int
    mamba_chunk_size: int
    max_position_embeddings: int
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    position_embedding: PositionEmbedding = PositionEmbedding.ROPE
    rope_theta: float = 10000.0
    # ~1/sqrt(hidden_size): every projection roughly keeps the scale of its input, so
    # attention is not uniform and Mamba states matter; with the usual 0.02 the random
    # model is nearly a bigram table and cache bugs would barely change its outputs.
    initializer_range: float = 0.125
    moe: MoeShape | None = None  # None: dense

    def __post_init__(self) -> None:
        kinds = {k.value for k in LayerKind}
        if not self.layer_pattern or set(self.layer_pattern) - kinds:
            raise ValueError(f"layer_pattern must use only {sorted(kinds)}: {self.layer_pattern!r}")
        if LayerKind.MOE.value in self.layer_pattern and self.moe is None:
            raise ValueError("'E' layers need a MoeShape (moe=...)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("num_attention_heads must divide hidden_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if self.mamba_intermediate_size % self.mamba_head_dim:
            raise ValueError("mamba_head_dim must divide mamba_expand * hidden_size")
        if self.mamba_num_heads % self.mamba_n_groups:
            raise ValueError("mamba_n_groups must divide the number of mamba heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba_num_heads(self) -> int:
        return self.mamba_intermediate_size // self.mamba_head_dim

    def layer_indices(self, kind: LayerKind) -> list[int]:
        return [i for i, c in enumerate(self.layer_pattern) if c == kind.value]


_TINY = ModelShape(
    hidden_size=64,
    layer_pattern="*MM*M",  # attention first and in the middle
    num_attention_heads=4,
    num_key_value_heads=2,
    mlp_intermediate_size=128,
    mamba_head_dim=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_chunk_size=16,  # short prompts already span several chunks
    max_position_embeddings=4096,
)
_SMALL = ModelShape(
    hidden_size=256,
    layer_pattern="MM*MMM*M",
    num_attention_heads=8,
    num_key_value_heads=4,
    mlp_intermediate_size=768,
    mamba_head_dim=32,
    mamba_n_groups=2,
    mamba_d_state=64,
    mamba_chunk_size=64,
    max_position_embeddings=8192,
    position_embedding=PositionEmbedding.NOPE,
    initializer_range=0.0625,
)
_BENCH = ModelShape(
    hidden_size=512,
    layer_pattern="MMM*" * 4,  # 1 attention : 3 mamba, like the production hybrids
    num_attention_heads=8,
    num_key_value_heads=2,
    mlp_intermediate_size=1536,
    mamba_head_dim=64,
    mamba_n_groups=2,
    mamba_d_state=128,
    mamba_chunk_size=128,
    max_position_embeddings=32768,
    position_embedding=PositionEmbedding.NOPE,
    initializer_range=0.044,
)

# Nemotron-H blocks are single mixers, so its patterns are longer and spell out the MLPs;
# the tiny one puts attention in the middle and last (Bamba's puts it first).
_NEMOTRON_PATTERNS = {
    Preset.TINY: "M*-M-*",
    Preset.SMALL: "M-M*-M-M-M*-M-",
    Preset.BENCH: "M-M-M-*-" * 4,
}
# Granite 4.0-H tiny keeps RoPE (the other presets use NoPE like the released models) and
# ends on an attention layer.
_GRANITE_TINY_PATTERN = "M*MM*"

PRESETS: dict[Preset, dict[Arch, ModelShape]] = {
    preset: {
        Arch.BAMBA: dataclasses.replace(base, position_embedding=PositionEmbedding.ROPE),
        Arch.GRANITEMOEHYBRID: (
            dataclasses.replace(base, layer_pattern=_GRANITE_TINY_PATTERN) if preset is Preset.TINY else base
        ),
        Arch.NEMOTRON_H: dataclasses.replace(
            base, layer_pattern=_NEMOTRON_PATTERNS[preset], position_embedding=PositionEmbedding.NOPE
        ),
    }
    for preset, base in ((Preset.TINY, _TINY), (Preset.SMALL, _SMALL), (Preset.BENCH, _BENCH))
}


# Granite 4.0-H Tiny: every layer's MLP is 64 experts (top 6) of width ~hidden/3 plus a
# shared expert of ~2/3 hidden; Nemotron 3 Nano: "E" layers of 128 experts (top 6) with a
# shared expert and routed_scaling_factor 2.5, alternating with Mamba, few attention layers
# and no plain MLPs. Scaled down: fewer experts, the same proportions. The tiny Nemotron one
# uses two expert groups (one picked per token) so that grouped routing is exercised; the
# released model has a single group, as its bench preset does.
_GRANITE_MOE = {
    Preset.TINY: MoeShape(num_experts=4, experts_per_token=2, expert_intermediate_size=32, shared_intermediate_size=64),
    Preset.BENCH: MoeShape(
        num_experts=16, experts_per_token=4, expert_intermediate_size=128, shared_intermediate_size=384
    ),
}
_NEMOTRON_MOE = {
    Preset.TINY: MoeShape(
        num_experts=8, experts_per_token=2, expert_intermediate_size=32, shared_intermediate_size=64,
        n_group=2, topk_group=1, routed_scaling_factor=2.5,
    ),
    Preset.BENCH: MoeShape(
        num_experts=16, experts_per_token=4, expert_intermediate_size=256, shared_intermediate_size=768,
        routed_scaling_factor=2.5,
    ),
}  # fmt: skip
_NEMOTRON_MOE_PATTERNS = {
    Preset.TINY: "ME*MEM*E",  # attention in the middle and before the last (expert) layer
    Preset.BENCH: "MEMEM*EM" * 4,
}

MOE_PRESETS: dict[Preset, dict[Arch, ModelShape]] = {
    preset: {
        Arch.GRANITEMOEHYBRID: dataclasses.replace(PRESETS[preset][Arch.GRANITEMOEHYBRID], moe=_GRANITE_MOE[preset]),
        Arch.NEMOTRON_H: dataclasses.replace(
            PRESETS[preset][Arch.NEMOTRON_H], layer_pattern=_NEMOTRON_MOE_PATTERNS[preset], moe=_NEMOTRON_MOE[preset]
        ),
    }
    for preset in (Preset.TINY, Preset.BENCH)
}


def preset_shape(arch: Arch, preset: Preset, moe: bool = False) -> ModelShape:
    """The shape of (arch, preset); moe=True: its mixture-of-experts variant (Granite 4.0-H and
    Nemotron-H, tiny and bench presets only)."""
    arch, preset = Arch(arch), Preset(preset)
    if not moe:
        return PRESETS[preset][arch]
    if arch not in MOE_PRESETS.get(preset, {}):
        raise ValueError(f"no mixture-of-experts variant of {arch.value}/{preset.value}")
    return MOE_PRESETS[preset][arch]


def with_attention_head_dim(shape: ModelShape, head_dim: int) -> ModelShape:
    """`shape` with attention heads of `head_dim` (as many as fit the hidden size; key-value
    heads no more than those)."""
    if head_dim <= 0 or shape.hidden_size % head_dim:
        raise ValueError(f"attention_head_dim must divide hidden_size {shape.hidden_size}, got {head_dim}")
    heads = shape.hidden_size // head_dim
    kv_heads = min(shape.num_key_value_heads, heads)
    while heads % kv_heads:
        kv_heads -= 1
    return dataclasses.replace(shape, num_attention_heads=heads, num_key_value_heads=kv_heads)
