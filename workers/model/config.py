"""One frozen description of a hybrid model, parsed from a Hugging Face `config.json`.

The three supported families differ only in naming and in a few knobs (µP multipliers,
RoPE or not, one residual block per layer or two). Everything past this module sees
`HybridModelConfig` and never the raw dictionary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from workers.errors import UnsupportedModelError


class ModelFamily(Enum):
    BAMBA = "bamba"
    GRANITE_MOE_HYBRID = "granitemoehybrid"
    NEMOTRON_H = "nemotron_h"


class MixerKind(Enum):
    MAMBA = "mamba"
    ATTENTION = "attention"
    MLP = "mlp"  # Nemotron-H's '-' layers: the block's mixer is an MLP
    MOE = "moe"  # Nemotron-H's 'E' layers: the block's mixer is a mixture of experts


class MlpKind(Enum):
    SWIGLU = "swiglu"  # act(gate) * up, then down
    RELU2 = "relu2"  # relu(up)^2, then down


class RouterKind(Enum):
    SOFTMAX_TOPK = "softmax_topk"  # Granite: top-k router logits, softmax over those k
    SIGMOID_GROUPED = "sigmoid_grouped"  # Nemotron-H (DeepSeek-V3): sigmoid scores, biased group/top-k choice


@dataclass(frozen=True)
class MoeShape:
    """Routed experts (each an MLP of the model's MlpKind) plus one shared expert on every token."""

    router: RouterKind
    n_experts: int
    top_k: int
    intermediate: int
    shared_intermediate: int
    # SIGMOID_GROUPED only: experts in n_group groups, topk_group groups chosen per token, then
    # the top_k experts among them; the chosen scores renormalised (norm_topk_prob), then scaled.
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    scaling: float = 1.0


@dataclass(frozen=True)
class BlockSpec:
    """One decoder layer: a mixer, and for Bamba/Granite a feed-forward after it (routed
    experts when `ffn_moe`: Granite 4.0-H MoE)."""

    mixer: MixerKind
    has_ffn: bool
    ffn_moe: bool = False


@dataclass(frozen=True)
class MambaShape:
    n_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    dt_min: float  # lower clamp of the softplus'd time step (0 = none)
    dt_max: float

    @property
    def intermediate(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.d_state

    @property
    def in_proj_dim(self) -> int:
        return self.intermediate + self.conv_dim + self.n_heads


@dataclass(frozen=True)
class AttentionShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int  # 0 means no positional embedding ("nope")
    rope_theta: float
    scale: float
    bias: bool


@dataclass(frozen=True)
class HybridModelConfig:
    family: ModelFamily
    vocab_size: int
    hidden_size: int
    blocks: tuple[BlockSpec, ...]
    mamba: MambaShape
    attention: AttentionShape
    mlp_kind: MlpKind
    mlp_intermediate: int
    mlp_bias: bool
    norm_eps: float
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    tie_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    moe: MoeShape | None = None  # the experts of MoE mixers / feed-forwards

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, b in enumerate(self.blocks) if b.mixer is MixerKind.ATTENTION)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, b in enumerate(self.blocks) if b.mixer is MixerKind.MAMBA)


def parse_hf_config(raw: dict[str, Any]) -> HybridModelConfig:
    """Validate a `config.json` dictionary and turn it into a `HybridModelConfig`."""
    model_type = raw.get("model_type")
    try:
        family = ModelFamily(model_type)
    except ValueError:
        supported = ", ".join(f.value for f in ModelFamily)
        raise UnsupportedModelError("model_type", model_type, f"supported: {supported}") from None
    if family is ModelFamily.NEMOTRON_H:
        return _parse_nemotron_h(raw)
    return _parse_bamba_like(raw, family)


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise UnsupportedModelError(key, None, "field is required")
    return raw[key]


def _check_activation(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UnsupportedModelError(field, value, f"supported activations: {', '.join(allowed)}")


def _rope(raw: dict[str, Any], head_dim: int) -> tuple[int, float]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError("rope_parameters.rope_type", rope_type, "only default RoPE is supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if raw.get("attn_rotary_emb"):
        return int(raw["attn_rotary_emb"]), theta
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    return int(head_dim * factor), theta


_LEGACY_LAYER_NAMES = {"mamba": "linear_attention", "attention": "full_attention"}


def _bamba_layer_types(raw: dict[str, Any], family: ModelFamily) -> list[str]:
    n_layers = int(_require(raw, "num_hidden_layers"))
    if family is ModelFamily.BAMBA:
        attn = set(raw.get("attn_layer_indices") or [])
        return ["full_attention" if i in attn else "linear_attention" for i in range(n_layers)]
    types = [_LEGACY_LAYER_NAMES.get(t, t) for t in _require(raw, "layer_types")]
    if len(types) != n_layers:
        raise UnsupportedModelError("layer_types", types, f"expected {n_layers} entries")
    return types


def _mamba_from_bamba_like(raw: dict[str, Any]) -> MambaShape:
    limit = raw.get("time_step_limit") or (0.0, math.inf)
    shape = MambaShape(
        n_heads=int(_require(raw, "mamba_n_heads")),
        head_dim=int(_require(raw, "mamba_d_head")),
        n_groups=int(raw.get("mamba_n_groups", 1)),
        d_state=int(_require(raw, "mamba_d_state")),
        d_conv=int(raw.get("mamba_d_conv", 4)),
        chunk_size=int(raw.get("mamba_chunk_size", 256)),
        conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
        dt_min=_as_float(limit[0]),
        dt_max=_as_float(limit[1]),
    )
    expand = raw.get("mamba_expand")
    if expand is not None and int(expand * raw["hidden_size"]) != shape.intermediate:
        raise UnsupportedModelError(
            "mamba_expand", expand, "mamba_expand * hidden_size must equal mamba_n_heads * mamba_d_head"
        )
    return shape


def _parse_bamba_like(raw: dict[str, Any], family: ModelFamily) -> HybridModelConfig:
    hidden = int(_require(raw, "hidden_size"))
    n_heads = int(_require(raw, "num_attention_heads"))
    head_dim = int(raw.get("head_dim") or hidden // n_heads)
    _check_activation("hidden_act", raw.get("hidden_act", "silu"), ("silu",))
    is_granite = family is ModelFamily.GRANITE_MOE_HYBRID
    moe = _granite_moe(raw) if is_granite else None
    layer_types = _bamba_layer_types(raw, family)
    for t in layer_types:
        if t not in ("linear_attention", "full_attention"):
            raise UnsupportedModelError("layer_types", t, "expected mamba/attention layers only")
    blocks = tuple(
        BlockSpec(MixerKind.MAMBA if t == "linear_attention" else MixerKind.ATTENTION, has_ffn=True, ffn_moe=moe is not None)
        for t in layer_types
    )
    uses_rope = not is_granite or raw.get("position_embedding_type") == "rope"
    rotary_dim, theta = _rope(raw, head_dim) if uses_rope else (0, 0.0)
    scale = float(raw.get("attention_multiplier", 1.0)) if is_granite else head_dim**-0.5
    return HybridModelConfig(
        family=family,
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden,
        blocks=blocks,
        mamba=_mamba_from_bamba_like(raw),
        attention=AttentionShape(
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=theta,
            scale=scale,
            bias=bool(raw.get("attention_bias", False)),
        ),
        mlp_kind=MlpKind.SWIGLU,
        mlp_intermediate=int(_require(raw, "shared_intermediate_size" if is_granite else "intermediate_size")),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)) if is_granite else 1.0,
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)) if is_granite else 1.0,
        logits_scaling=float(raw.get("logits_scaling", 1.0)) if is_granite else 1.0,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        eos_token_ids=_eos_ids(raw),
        moe=moe,
    )


def _granite_moe(raw: dict[str, Any]) -> MoeShape | None:
    """Granite 4.0-H's routed experts (num_local_experts > 0; 0 is the dense model, whose
    "shared" MLP is its only MLP)."""
    n_experts = int(raw.get("num_local_experts") or 0)
    if n_experts == 0:
        return None
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= n_experts:
        raise UnsupportedModelError("num_experts_per_tok", top_k, f"must be in 1..num_local_experts ({n_experts})")
    return MoeShape(
        router=RouterKind.SOFTMAX_TOPK,
        n_experts=n_experts,
        top_k=top_k,
        intermediate=int(_require(raw, "intermediate_size")),
        shared_intermediate=int(_require(raw, "shared_intermediate_size")),
    )


def _nemotron_moe(raw: dict[str, Any]) -> MoeShape:
    if raw.get("moe_latent_size") is not None:
        raise UnsupportedModelError("moe_latent_size", raw["moe_latent_size"], "latent expert projections are unsupported")
    n_experts = int(_require(raw, "n_routed_experts"))
    top_k = int(_require(raw, "num_experts_per_tok"))
    n_group, topk_group = int(raw.get("n_group", 1)), int(raw.get("topk_group", 1))
    if not 0 < top_k <= n_experts:
        raise UnsupportedModelError("num_experts_per_tok", top_k, f"must be in 1..n_routed_experts ({n_experts})")
    if n_group < 1 or n_experts % n_group or not 0 < topk_group <= n_group or n_experts // n_group < 2:
        raise UnsupportedModelError(
            "n_group", n_group, f"must divide n_routed_experts ({n_experts}) into groups of 2+, topk_group <= n_group"
        )
    return MoeShape(
        router=RouterKind.SIGMOID_GROUPED,
        n_experts=n_experts,
        top_k=top_k,
        intermediate=int(_require(raw, "moe_intermediate_size")),
        shared_intermediate=int(_require(raw, "moe_shared_expert_intermediate_size")),
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        scaling=float(raw.get("routed_scaling_factor", 1.0)),
    )


_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_NEMOTRON_MIXERS = {
    "linear_attention": MixerKind.MAMBA,
    "full_attention": MixerKind.ATTENTION,
    "mlp": MixerKind.MLP,
    "moe": MixerKind.MOE,
}


def _parse_nemotron_h(raw: dict[str, Any]) -> HybridModelConfig:
    if raw.get("hybrid_override_pattern"):
        types = [_NEMOTRON_PATTERN.get(c, c) for c in raw["hybrid_override_pattern"]]
    else:
        types = list(_require(raw, "layers_block_type"))
    for t in types:
        if t not in _NEMOTRON_MIXERS:
            raise UnsupportedModelError("layers_block_type", t, "supported layers: M, *, -, E")
    if int(raw.get("num_nextn_predict_layers") or 0) > 0:
        raise UnsupportedModelError("num_nextn_predict_layers", raw["num_nextn_predict_layers"], "MTP is unsupported")
    _check_activation("mlp_hidden_act", raw.get("mlp_hidden_act", "relu2"), ("relu2",))
    _check_activation("mamba_hidden_act", raw.get("mamba_hidden_act", "silu"), ("silu",))
    hidden = int(_require(raw, "hidden_size"))
    n_heads = int(_require(raw, "num_attention_heads"))
    head_dim = int(raw.get("head_dim") or hidden // n_heads)
    limit_max = (raw.get("time_step_limit") or (0.0, math.inf))[1]
    return HybridModelConfig(
        family=ModelFamily.NEMOTRON_H,
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden,
        blocks=tuple(BlockSpec(_NEMOTRON_MIXERS[t], has_ffn=False) for t in types),
        mamba=MambaShape(
            n_heads=int(_require(raw, "mamba_num_heads")),
            head_dim=int(_require(raw, "mamba_head_dim")),
            n_groups=int(raw.get("n_groups", 1)),
            d_state=int(_require(raw, "ssm_state_size")),
            d_conv=int(raw.get("conv_kernel", 4)),
            chunk_size=int(raw.get("chunk_size", 128)),
            conv_bias=bool(raw.get("use_conv_bias", True)),
            proj_bias=bool(raw.get("use_bias", False)),
            dt_min=float(raw.get("time_step_min", 0.0)),
            dt_max=_as_float(limit_max),
        ),
        attention=AttentionShape(
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            rotary_dim=0,
            rope_theta=0.0,
            scale=head_dim**-0.5,
            bias=bool(raw.get("attention_bias", False)),
        ),
        mlp_kind=MlpKind.RELU2,
        mlp_intermediate=int(_require(raw, "intermediate_size")),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        eos_token_ids=_eos_ids(raw),
        moe=_nemotron_moe(raw) if "moe" in types else None,
    )


def _as_float(value: Any) -> float:
    """transformers 5 writes non-finite floats as {"__float__": "Infinity"} in config.json."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
