"""ModelShape -> transformers config, one small function per architecture.

Field names follow the transformers 5.23 config classes exactly so that the saved
config.json is what the released checkpoints of each family look like.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import BambaConfig, GraniteMoeHybridConfig, NemotronHConfig, PretrainedConfig

from workers.checkpoint.presets import Arch, LayerKind, ModelShape
from workers.checkpoint.tokens import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE

# Non-trivial muP multipliers, so an engine that forgets one of them disagrees with
# transformers (values of the order the released Granite 4.0-H models use).
GRANITE_EMBEDDING_MULTIPLIER = 12.0
GRANITE_RESIDUAL_MULTIPLIER = 0.22
GRANITE_ATTENTION_MULTIPLIER = 0.015625
GRANITE_LOGITS_SCALING = 8.0

_HF_LAYER_TYPE = {
    LayerKind.MAMBA: "linear_attention",
    LayerKind.ATTENTION: "full_attention",
    LayerKind.MLP: "mlp",
    LayerKind.MOE: "moe",
}


def _common(shape: ModelShape) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=shape.initializer_range,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
        dtype="float32",
    )


def _no_mlp_only_layers(shape: ModelShape, arch: Arch) -> None:
    for kind in (LayerKind.MLP, LayerKind.MOE):
        if kind.value in shape.layer_pattern:
            raise ValueError(f"{arch.value} layers always carry their MLP; {kind.value!r} is only valid for nemotron_h")


def _granite_ffn(shape: ModelShape) -> dict[str, Any]:
    if shape.moe is None:  # Dense Granite 4.0-H: no routed experts, the "shared" MLP is the MLP.
        return dict(
            num_local_experts=0,
            num_experts_per_tok=0,
            intermediate_size=shape.mlp_intermediate_size,
            shared_intermediate_size=shape.mlp_intermediate_size,
        )
    return dict(
        num_local_experts=shape.moe.num_experts,
        num_experts_per_tok=shape.moe.experts_per_token,
        intermediate_size=shape.moe.expert_intermediate_size,
        shared_intermediate_size=shape.moe.shared_intermediate_size,
    )


def _nemotron_experts(shape: ModelShape) -> dict[str, Any]:
    if shape.moe is None:  # Dense: no MoE layers in the pattern; zero the expert counts so nothing looks MoE.
        return dict(n_routed_experts=0, num_experts_per_tok=0, n_shared_experts=0)
    moe = shape.moe
    return dict(
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.experts_per_token,
        n_shared_experts=1,
        moe_intermediate_size=moe.expert_intermediate_size,
        moe_shared_expert_intermediate_size=moe.shared_intermediate_size,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=moe.norm_topk_prob,
    )


def _bamba_like_mamba(shape: ModelShape) -> dict[str, Any]:
    """Bamba and Granite 4.0-H name their Mamba fields alike."""
    return {
        "mamba_n_heads": shape.mamba_num_heads,
        "mamba_d_head": shape.mamba_head_dim,
        "mamba_n_groups": shape.mamba_n_groups,
        "mamba_d_state": shape.mamba_d_state,
        "mamba_d_conv": shape.mamba_d_conv,
        "mamba_expand": shape.mamba_expand,
        "mamba_chunk_size": shape.mamba_chunk_size,
    }


def _bamba(shape: ModelShape, overrides: dict[str, Any]) -> BambaConfig:
    _no_mlp_only_layers(shape, Arch.BAMBA)
    return BambaConfig(
        **_common(shape),
        num_hidden_layers=len(shape.layer_pattern),
        attn_layer_indices=shape.layer_indices(LayerKind.ATTENTION),
        intermediate_size=shape.mlp_intermediate_size,
        **_bamba_like_mamba(shape),
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        **overrides,
    )


def _granite(shape: ModelShape, overrides: dict[str, Any]) -> GraniteMoeHybridConfig:
    _no_mlp_only_layers(shape, Arch.GRANITEMOEHYBRID)
    return GraniteMoeHybridConfig(
        **_common(shape),
        num_hidden_layers=len(shape.layer_pattern),
        layer_types=[_HF_LAYER_TYPE[LayerKind(c)] for c in shape.layer_pattern],
        **_granite_ffn(shape),
        embedding_multiplier=GRANITE_EMBEDDING_MULTIPLIER,
        residual_multiplier=GRANITE_RESIDUAL_MULTIPLIER,
        attention_multiplier=GRANITE_ATTENTION_MULTIPLIER,
        logits_scaling=GRANITE_LOGITS_SCALING,
        position_embedding_type=shape.position_embedding.value,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        **_bamba_like_mamba(shape),
        **overrides,
    )


def _nemotron_h(shape: ModelShape, overrides: dict[str, Any]) -> NemotronHConfig:
    return NemotronHConfig(
        **_common(shape),
        layers_block_type=[_HF_LAYER_TYPE[LayerKind(c)] for c in shape.layer_pattern],
        head_dim=shape.head_dim,
        intermediate_size=shape.mlp_intermediate_size,
        mamba_num_heads=shape.mamba_num_heads,
        mamba_head_dim=shape.mamba_head_dim,
        n_groups=shape.mamba_n_groups,
        ssm_state_size=shape.mamba_d_state,
        conv_kernel=shape.mamba_d_conv,
        expand=shape.mamba_expand,
        chunk_size=shape.mamba_chunk_size,
        **_nemotron_experts(shape),
        **overrides,
    )


_BUILDERS: dict[Arch, Callable[[ModelShape, dict[str, Any]], PretrainedConfig]] = {
    Arch.BAMBA: _bamba,
    Arch.GRANITEMOEHYBRID: _granite,
    Arch.NEMOTRON_H: _nemotron_h,
}


def build_config(arch: Arch, shape: ModelShape, **hf_overrides: Any) -> PretrainedConfig:
    """The transformers config of `arch` with `shape`; hf_overrides go straight to the config class."""
    return _BUILDERS[Arch(arch)](shape, hf_overrides)
