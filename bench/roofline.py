"""This machine's fp32 matmul roofline for one model: the tokens/s a forward pass could reach if
it did nothing but its weight matmuls.

For M tokens per forward, every linear layer's weight is multiplied once by an [M, in] input
(`F.linear`, the same threads); the best of a few timed repeats is the floor time t(M), and
M / t(M) the ceiling in tokens/s. Decode at concurrency c runs M = c; a prefill step runs up to
the scheduler's token budget. A measured figure divided by the ceiling is the fraction of the
roofline it reaches (attention, Mamba scans, sampling and dispatch are the rest).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]


def matmul_floor_seconds(weights: list[torch.Tensor], m: int, repeats: int = 5) -> float:
    """Best wall time of one pass of [m, in] @ W.T over every weight."""
    inputs = [torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights]
    best = float("inf")
    with torch.inference_mode():
        for x, w in zip(inputs, weights):  # warm up: first-touch and library dispatch
            F.linear(x, w)
        for _ in range(repeats):
            start = time.perf_counter()
            for x, w in zip(inputs, weights):
                F.linear(x, w)
            best = min(best, time.perf_counter() - start)
    return best


def roofline(model: nn.Module, token_counts: list[int]) -> dict[str, dict[str, float]]:
    """{str(M): {"floor_s": t(M), "tokens_per_s": M / t(M)}} for each M."""
    weights = linear_weights(model)
    out = {}
    for m in sorted(set(token_counts)):
        floor = matmul_floor_seconds(weights, m)
        out[str(m)] = {"floor_s": floor, "tokens_per_s": m / floor}
    return out
