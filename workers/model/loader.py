"""Load a Hugging Face checkpoint directory into `HybridLM`.

Each family names its tensors differently; a table of regular expressions maps a
checkpoint name to one of ours, and names that fuse (q/k/v into one projection,
gate/up into one MLP matrix, Nemotron-H's per-expert matrices into one stack) carry a part
index so they are concatenated in order.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from workers.errors import CheckpointError
from workers.model.config import HybridModelConfig, ModelFamily, parse_hf_config
from workers.model.device import require_device
from workers.model.hybrid_lm import HybridLM

# (pattern, replacement, part): part orders the pieces of a fused tensor.
_MAMBA_RULES = [
    (r"\.(mamba|mixer)\.conv1d\.weight$", r".mixer.conv_weight", 0),
    (r"\.(mamba|mixer)\.conv1d\.bias$", r".mixer.conv_bias", 0),
    (r"\.(mamba|mixer)\.(in_proj|out_proj|norm)\.(weight|bias)$", r".mixer.\2.\3", 0),
    (r"\.(mamba|mixer)\.(A_log|D|dt_bias)$", r".mixer.\2", 0),
]
_ATTENTION_RULES = [
    (r"\.(self_attn|mixer)\.q_proj\.(weight|bias)$", r".mixer.qkv.\2", 0),
    (r"\.(self_attn|mixer)\.k_proj\.(weight|bias)$", r".mixer.qkv.\2", 1),
    (r"\.(self_attn|mixer)\.v_proj\.(weight|bias)$", r".mixer.qkv.\2", 2),
    (r"\.(self_attn|mixer)\.o_proj\.(weight|bias)$", r".mixer.o_proj.\2", 0),
]
_RULES: dict[ModelFamily, list[tuple[str, str, int]]] = {
    ModelFamily.BAMBA: [
        (r"^model\.embed_tokens\.weight$", "embed.weight", 0),
        (r"^model\.final_layernorm\.weight$", "final_norm.weight", 0),
        (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"blocks.\1.norm.weight", 0),
        (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.weight$", r"blocks.\1.ffn_norm.weight", 0),
        (r"^model\.layers\.(\d+)\.feed_forward\.gate_proj\.(weight|bias)$", r"blocks.\1.ffn.up.\2", 0),
        (r"^model\.layers\.(\d+)\.feed_forward\.up_proj\.(weight|bias)$", r"blocks.\1.ffn.up.\2", 1),
        (r"^model\.layers\.(\d+)\.feed_forward\.down_proj\.(weight|bias)$", r"blocks.\1.ffn.down.\2", 0),
    ],
    ModelFamily.GRANITE_MOE_HYBRID: [
        (r"^model\.embed_tokens\.weight$", "embed.weight", 0),
        (r"^model\.norm\.weight$", "final_norm.weight", 0),
        (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"blocks.\1.norm.weight", 0),
        (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"blocks.\1.ffn_norm.weight", 0),
        (r"^model\.layers\.(\d+)\.shared_mlp\.input_linear\.weight$", r"blocks.\1.ffn.up.weight", 0),
        (r"^model\.layers\.(\d+)\.shared_mlp\.output_linear\.weight$", r"blocks.\1.ffn.down.weight", 0),
    ],
    ModelFamily.NEMOTRON_H: [
        (r"^backbone\.embeddings\.weight$", "embed.weight", 0),
        (r"^backbone\.norm_f\.weight$", "final_norm.weight", 0),
        (r"^backbone\.layers\.(\d+)\.norm\.weight$", r"blocks.\1.norm.weight", 0),
        (r"^backbone\.layers\.(\d+)\.mixer\.up_proj\.(weight|bias)$", r"blocks.\1.mixer.up.\2", 0),
        (r"^backbone\.layers\.(\d+)\.mixer\.down_proj\.(weight|bias)$", r"blocks.\1.mixer.down.\2", 0),
    ],
}
# Routed experts, in the names save_pretrained writes (and transformers' in-memory ones).
# Granite MoE's shared_mlp is the MoE's shared expert, where the dense model's is its MLP.
_GRANITE_MOE_RULES = [
    (r"^model\.layers\.(\d+)\.shared_mlp\.input_linear\.weight$", r"blocks.\1.ffn.shared.up.weight", 0),
    (r"^model\.layers\.(\d+)\.shared_mlp\.output_linear\.weight$", r"blocks.\1.ffn.shared.down.weight", 0),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.(input_linear\.weight|experts\.gate_up_proj)$",
     r"blocks.\1.ffn.experts_up", 0),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.(output_linear\.weight|experts\.down_proj)$",
     r"blocks.\1.ffn.experts_down", 0),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.router\.(layer\.)?weight$", r"blocks.\1.ffn.router", 0),
]  # fmt: skip
_NEMOTRON_MOE_RULES = [
    (r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.gate\.weight$", r"blocks.\1.mixer.router", 0),
    (r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.gate\.e_score_correction_bias$", r"blocks.\1.mixer.score_bias", 0),
    (r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.shared_experts\.(up|down)_proj\.(weight|bias)$",
     r"blocks.\1.mixer.shared.\2.\3", 0),
    (r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.experts\.(up|down)_proj$", r"blocks.\1.mixer.experts_\2", 0),
]  # fmt: skip
# One matrix per expert: part = expert index, stacked in that order.
_NEMOTRON_EXPERT = re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.mixer\.experts\.(\d+)\.(up|down)_proj\.weight$")
_LAYER_PREFIX = re.compile(r"^(?:model|backbone)\.layers\.(\d+)(\..*)$")


def _internal_name(config: HybridModelConfig, name: str) -> tuple[str, int] | None:
    family = config.family
    if name == "lm_head.weight":
        return "lm_head.weight", 0
    rules = _RULES[family]
    if config.moe is not None and family is ModelFamily.GRANITE_MOE_HYBRID:
        rules = _GRANITE_MOE_RULES + rules
    elif config.moe is not None and family is ModelFamily.NEMOTRON_H:
        expert = _NEMOTRON_EXPERT.match(name)
        if expert:
            return f"blocks.{expert.group(1)}.mixer.experts_{expert.group(3)}", int(expert.group(2))
        rules = _NEMOTRON_MOE_RULES + rules
    for pattern, repl, part in rules:
        if re.search(pattern, name):
            return re.sub(pattern, repl, name), part
    layer = _LAYER_PREFIX.match(name)
    if layer:
        for pattern, repl, part in _MAMBA_RULES + _ATTENTION_RULES:
            if re.search(pattern, layer.group(2)):
                return f"blocks.{layer.group(1)}" + re.sub(pattern, repl, layer.group(2)), part
    return None


def read_model_config(path: Path) -> HybridModelConfig:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON: {e}") from e
    return parse_hf_config(raw)


def load_model(path: Path | str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> HybridLM:
    require_device(device)  # before any weight is read: "no CUDA here" is not a failed copy later
    path = Path(path)
    config = read_model_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    mapped = _internal_name(config, name)
                    if mapped is None:
                        raise CheckpointError(f"{file.name}: unexpected tensor {name!r} for {config.family.value}")
                    pieces.setdefault(mapped[0], {})[mapped[1]] = f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise CheckpointError(f"{file}: cannot read safetensors: {e}") from e

    with torch.device("meta"):
        model = HybridLM(config)
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for name, parts in pieces.items():
        if name.endswith(("experts_up", "experts_down")) and next(iter(parts.values())).dim() == 2:
            if sorted(parts) != list(range(config.moe.n_experts)):
                raise CheckpointError(f"{path}: {name!r} has experts {sorted(parts)}, expected 0..{config.moe.n_experts - 1}")
            tensor = torch.stack([parts[i] for i in sorted(parts)])
        elif len(parts) > 1:
            tensor = torch.cat([parts[i] for i in sorted(parts)], dim=0)
        else:
            tensor = parts[0]
        if name.endswith("conv_weight"):
            tensor = tensor.reshape(tensor.shape[0], -1)  # [C, 1, k] -> [C, k]
        if name not in expected:
            if name == "lm_head.weight" and config.tie_embeddings:
                continue
            raise CheckpointError(f"{path}: tensor {name!r} does not belong to this model")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
        state[name] = tensor.to(dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    model = model.to(dtype).eval().requires_grad_(False)
    for name, param in model.named_parameters():
        if name.endswith("score_bias"):  # transformers keeps e_score_correction_bias in fp32
            param.data = pieces[name][0].to(device=device, dtype=torch.float32)
    return model
