"""Random weights that make a useful test model.

transformers' own init leaves many parameters constant (RMSNorm weights = 1, conv and
projection biases = 0, Mamba D = 1 and dt_bias = 1, A_log = log(1..H) in every layer).
An engine that mixes up heads, groups or layers would still agree with the reference on
such weights, so every constant vector gets per-element noise here. The lm_head is
re-scaled so that logits have a clear spread: greedy decoding is then robust to float
noise (no near-ties everywhere) and sampling is not uniform.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Std of the logits for a unit-RMS final hidden state; ~3 gives a peaked but not
# one-hot next-token distribution over the ~100 characters.
TARGET_LOGIT_STD = 3.0
_DT_MIN, _DT_MAX = 1e-3, 1e-1  # Mamba2's usual dt init range
_A_MIN, _A_MAX = 1.0, 16.0
_ROUTING_BIAS_STD = 0.1  # against sigmoid router scores spread over ~0.2


def _uniform(shape: torch.Size, low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=gen)


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def _mamba_value(name: str, param: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.log(_uniform(param.shape, _A_MIN, _A_MAX, gen))
    if leaf == "D":
        return _uniform(param.shape, 0.5, 1.5, gen)
    if leaf == "dt_bias":
        log_dt = _uniform(param.shape, math.log(_DT_MIN), math.log(_DT_MAX), gen)
        return _inverse_softplus(torch.exp(log_dt))
    return None


def _jittered_constant(param: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
    if param.dim() != 1 or not bool((param == param[0]).all()):
        return None
    scale = 0.1 if float(param[0]) != 0.0 else 0.02
    return param + scale * torch.randn(param.shape, generator=gen)


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int, logits_divisor: float = 1.0, embedding_gain: float = 1.0) -> None:
    """Replaces the constant parameters and rescales lm_head; deterministic in `seed`.

    logits_divisor: what the model divides logits by (Granite's logits_scaling).
    embedding_gain: how much more the model weighs embeddings than layer outputs on the
    residual stream (Granite: embedding_multiplier / residual_multiplier, ~55). The
    embedding table is divided by it; otherwise the embeddings drown every layer and the
    model is a bigram table that ignores its context (and its cache).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        new = _mamba_value(name, param, gen)
        if new is None:
            new = _jittered_constant(param, gen)
        if new is not None:
            param.copy_(new.to(param.dtype))

    model.get_input_embeddings().weight.div_(embedding_gain)
    lm_head = model.get_output_embeddings()
    hidden = lm_head.weight.shape[1]
    std = TARGET_LOGIT_STD * logits_divisor / math.sqrt(hidden)
    lm_head.weight.copy_(torch.randn(lm_head.weight.shape, generator=gen) * std)

    # Nemotron-H's expert-choice bias (a buffer, zero at init): with zeros an engine that
    # ignored it would still route like the reference. Drawn last, so dense models are unchanged.
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(_ROUTING_BIAS_STD * torch.randn(buffer.shape, generator=gen))
