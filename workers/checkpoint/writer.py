"""Writes a complete random-weight Hugging Face checkpoint directory.

    out_dir/
      config.json              transformers config of the chosen family
      model.safetensors        fp32 random weights (weights.py)
      generation_config.json   eos/pad/bos ids
      tokenizer.json, tokenizer_config.json, chat_template.jinja
      hybridserve.json         eos + never-sample ids for the engine (metadata.py)

Same (arch, preset, moe, seed) -> byte-identical model.safetensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from workers.checkpoint.configs import build_config
from workers.checkpoint.metadata import ServingMetadata
from workers.checkpoint.presets import Arch, ModelShape, Preset, preset_shape, with_attention_head_dim
from workers.checkpoint.tokenizer import write_tokenizer
from workers.checkpoint.tokens import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    NEVER_SAMPLE_TOKEN_IDS,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
)
from workers.checkpoint.weights import randomize_weights


def build_random_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A transformers model with deterministic random fp32 weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Only Granite has these muP multipliers; 1.0 means "not scaled" for the others.
    randomize_weights(
        model,
        seed,
        logits_divisor=float(getattr(config, "logits_scaling", 1.0)),
        embedding_gain=float(getattr(config, "embedding_multiplier", 1.0))
        / float(getattr(config, "residual_multiplier", 1.0)),
    )
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    return model.eval()


def make_model(
    out_dir: str | Path, arch: Arch | str, preset: Preset | str, seed: int = 0, moe: bool = False,
    attention_head_dim: int | None = None,
) -> Path:
    """Writes the checkpoint of (arch, preset, seed) into out_dir and returns its path; moe=True:
    the preset's mixture-of-experts variant (`presets.preset_shape`); attention_head_dim: fewer,
    wider attention heads (vLLM's CPU attention runs heads of 32 and more, the tiny preset's are 16)."""
    shape = preset_shape(Arch(arch), Preset(preset), moe)
    if attention_head_dim is not None:
        shape = with_attention_head_dim(shape, attention_head_dim)
    return make_model_of_shape(out_dir, arch, shape, seed)


def make_model_of_shape(out_dir: str | Path, arch: Arch | str, shape: ModelShape, seed: int = 0) -> Path:
    """`make_model` of any shape (a preset scaled up for a GPU benchmark, say)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(Arch(arch), shape)
    model = build_random_model(config, seed)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    ServingMetadata(
        eos_token_ids=(EOS_TOKEN_ID,),
        never_sample_token_ids=NEVER_SAMPLE_TOKEN_IDS,
        vocab_size=VOCAB_SIZE,
    ).write(out)
    return out
