"""This machine's roofline for one model: the tokens/s a forward pass could reach if it did
nothing but move the bytes it must move at the measured memory bandwidth and do the weight
matmuls' arithmetic at the measured fp32 peak, whichever takes longer.

    forward of M tokens over S sequences:
      bytes  = every linear weight once + each sequence's Mamba state read and written once
      flops  = 2 · M · (parameters of the blocks' linears) + 2 · S · (LM head parameters)
               (logits only for the row each sequence samples from)
      floor  = max(bytes / read bandwidth, flops / peak)          ceiling = M / floor

Both machine figures are measured here, with the benchmark's threads, as the best of a few
probes (a figure any code reached on this machine is attainable, so the best one is the ceiling):

    read bandwidth  a streaming pass over at least 512 MB: torch's sum over one buffer, and
                    the panel kernel's one-row matmul over the model's own packed weights
                    (it reads each weight once and writes a few hundred floats)
    fp32 peak       the best measured matmul rate (operands hot in the caches): MKL sgemm at
                    256 x 512 x 512 and 1024 x 1024 x 1024, the panel kernel at 16 rows, and
                    the best `host_speed` reading around the benchmark's runs (the same
                    256 x 512 x 512 sgemm, taken over the whole benchmark: the cores' pace
                    moves by a third within seconds here, and probes taken once, in a slow
                    spell, put peers above 100%). A measured attainable peak, not the
                    datasheet's: a kernel beating every probe would show above 100%

K/V reads of attention are left out: at the benchmark's 128-token prompts they are about 1% of
a decode step's bytes (the long-context rows, where they dominate, report no roofline).
Before this definition the floor was "the best time of F.linear over every weight", which
peers with faster matmuls exceeded (vLLM reached 118% of it): that was a library's speed,
not a ceiling.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.extensions import panel_kernels

STREAM_BYTES = 512 << 20  # far beyond any L3 here (32 MB)


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first touch, library dispatch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(weights: list[torch.Tensor], repeats: int = 5) -> dict[str, float]:
    """GB/s of each read probe (see the module docstring)."""
    buffer = torch.randn(STREAM_BYTES // 4)
    probes = {"torch_sum": buffer.numel() * 4 / _best_seconds(buffer.sum, repeats) / 1e9}
    kernels = panel_kernels()
    if kernels is not None:
        packed = [(kernels.pack_panels(w.float()), w.shape[0]) for w in weights]
        rows = [torch.randn(1, w.shape[1]) for w in weights]
        # Enough passes for 512 MB; a model smaller than the L3 would be read from it after the
        # first pass (the bench models are 8x larger than this CPU's 32 MB L3).
        passes = max(1, STREAM_BYTES // sum(p.numel() * 4 for p, _ in packed))

        def one_row_pass() -> None:
            for _ in range(passes):
                for (p, n), x in zip(packed, rows):
                    kernels.panel_linear(x, p, n, None)

        nbytes = passes * sum(p.numel() * 4 for p, _ in packed)
        probes["panel_one_row"] = nbytes / _best_seconds(one_row_pass, repeats) / 1e9
    return probes


_SGEMM: tuple[torch.Tensor, torch.Tensor] | None = None


def _sgemm_operands() -> tuple[torch.Tensor, torch.Tensor]:
    """x [256, 512] and w [512, 512]: the peak probe's sgemm and host_speed's, the same one so
    that their readings compare."""
    global _SGEMM
    if _SGEMM is None:
        _SGEMM = torch.randn(256, 512), torch.randn(512, 512)
    return _SGEMM


def host_speed(seconds: float = 0.02) -> float:
    """GFLOPS of a small sgemm hot in the caches, kept up for about `seconds`: the pace of this
    machine's cores right now. On these shared machines it moves by up to a third within seconds
    (the same in-cache loop took 11 ms in one second and 19 ms a few seconds later, with no steal
    time reported), so each benchmark run records it, and a slow spell shows beside the figure
    it slowed."""
    x, w = _sgemm_operands()
    F.linear(x, w)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        F.linear(x, w)
        calls += 1
    return 2 * x.shape[0] * x.shape[1] * w.shape[0] * calls / elapsed / 1e9


def fp32_peak(repeats: int = 20) -> dict[str, float]:
    """GFLOPS of each compute probe, operands hot in the caches."""
    x, w = _sgemm_operands()
    probes = {"mkl_256x512x512": 2 * 256 * 512 * 512 / _best_seconds(lambda: F.linear(x, w), repeats) / 1e9}
    big = torch.randn(1024, 1024)
    probes["mkl_1024x1024x1024"] = 2 * 1024**3 / _best_seconds(lambda: F.linear(big, big), max(3, repeats // 4)) / 1e9
    kernels = panel_kernels()
    if kernels is not None:
        x16, p = torch.randn(16, 512), kernels.pack_panels(torch.randn(1024, 512))
        seconds = _best_seconds(lambda: kernels.panel_linear(x16, p, 1024, None), repeats)
        probes["panel_16_rows"] = 2 * 16 * 1024 * 512 / seconds / 1e9
    return probes


def forward_key(tokens: int, sequences: int) -> str:
    """The roofline entry of a forward of `tokens` tokens over `sequences` sequences."""
    return f"{tokens}/{sequences}"


def roofline(
    model: nn.Module, forwards: list[tuple[int, int]], state_bytes_per_sequence: int,
    peak_readings: dict[str, float] | None = None,
) -> dict[str, object]:
    """{"machine": the probes and the ceilings used, forward_key(M, S): {"floor_s", "tokens_per_s",
    "bound"}} for each forward of (M tokens, S sequences). `peak_readings`: fp32 GFLOPS the
    caller measured meanwhile (the best host_speed reading), taken as peak probes too."""
    weights = linear_weights(model)
    head = getattr(model, "lm_head", None)
    head_params = head.weight.numel() if isinstance(head, nn.Linear) else 0
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    block_params = sum(w.numel() for w in weights) - head_params
    with torch.inference_mode():
        bandwidth, peak = read_bandwidth(weights), fp32_peak() | (peak_readings or {})
    gb_s, gflops = max(bandwidth.values()), max(peak.values())
    out: dict[str, object] = {
        "machine": {
            "read_gb_s": gb_s, "peak_gflops": gflops, "read_probes_gb_s": bandwidth, "peak_probes_gflops": peak,
            "weight_bytes": weight_bytes, "state_bytes_per_sequence": state_bytes_per_sequence,
        },  # fmt: skip
    }
    for tokens, sequences in sorted(set(forwards)):
        memory_s = (weight_bytes + 2 * sequences * state_bytes_per_sequence) / (gb_s * 1e9)
        compute_s = 2 * (tokens * block_params + sequences * head_params) / (gflops * 1e9)
        floor = max(memory_s, compute_s)
        out[forward_key(tokens, sequences)] = {
            "floor_s": floor,
            "tokens_per_s": tokens / floor,
            "bound": "memory" if memory_s >= compute_s else "compute",
        }
    return out
