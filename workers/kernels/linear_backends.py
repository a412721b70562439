"""The ways a linear layer's weight can be multiplied on the fast path, and their packed copies.

    TORCH          F.linear on the weight as loaded (MKL sgemm): the reference
    ONEDNN_PACKED  oneDNN on a copy of the weight in its blocked layout
    PANELS         csrc/panel_gemm.cpp on a copy packed into 16-column k-major panels
    PANELS_INT8    the same kernel on the weight quantized to int8 + per-channel scales: other
                   numbers, so never a tuning candidate (the engine's int8 mode installs it)

    packed = pack_for(backend, weight)                   # a copy (int8: panels and scales)
    y = run_packed(backend, x, packed, bias, out_features)
    fn, args = bind(backend, weight, packed, bias, out_features)   # the same, resolved once:
    y = fn(x, *args)

`linear_tuning.py` measures which backend each weight shape and batch size uses (the plan:
`linear_plan.py`; the dispatch: `tuned_linear.TunedLinear`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
import torch.nn.functional as F

from workers.kernels.extensions import panel_kernels


class LinearBackend(Enum):
    TORCH = "torch"  # F.linear on the weight as loaded: the reference
    ONEDNN_PACKED = "onednn_packed"  # oneDNN matmul on the weight reordered once into its blocked layout
    PANELS = "panels"  # csrc/panel_gemm.cpp on the weight packed into 16-column panels
    # The same kernel on the weight quantized to int8 (`quantize_int8`): other numbers, so never
    # a tuning candidate; only the engine's weight_quantization=int8 installs it (`int8_plan`).
    PANELS_INT8 = "panels_int8"

    @property
    def packed(self) -> bool:
        return self is not LinearBackend.TORCH


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# oneDNN picks the blocked layout of a packed weight for a batch size. Without one it assumes a
# small batch, and that layout is the slow one where oneDNN matters, at prompt chunks: the
# `bench` GraniteMoeHybrid's 3072x512 gate-and-up weight ran at 116 GFLOPS at 1,024 rows on this
# AVX2 host against 135 in the layout picked for 1,024 rows (15 interleaved rounds, 2 threads);
# at 256 rows the two were within noise. Any layout multiplies any number of rows, so one pack
# still serves all, and the tuner measures it at every bucket like any other backend. The rows
# are those of the tuner's prefill bucket (`LinearTuning.buckets[-1]`), where it is measured.
ONEDNN_LAYOUT_ROWS = 1024


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout for batches of `ONEDNN_LAYOUT_ROWS` rows (a copy)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_LAYOUT_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def available_backends() -> tuple[LinearBackend, ...]:
    """The backends this process can run: the reference, oneDNN when torch has it, the panel
    kernel when it builds here (built on first call: the runner calls at start-up)."""
    found = [LinearBackend.TORCH]
    if packing_available():
        found.append(LinearBackend.ONEDNN_PACKED)
    if panel_kernels() is not None:
        found.append(LinearBackend.PANELS)
    return tuple(found)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: weight ~= scale[:, None] * q, |q| <= 127, with
    scale = max |row| / 127 (so the largest weight of each row is exact and every weight is
    within scale / 2). An all-zero row has scale 0 and q 0; a non-finite weight is an error
    (its row would silently turn to NaN)."""
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight holding inf or NaN")
    scale = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


Packed = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # int8 panels travel with their scales


def pack_for(backend: LinearBackend, weight: torch.Tensor) -> Packed:
    """`backend`'s packed copy of `weight`."""
    with torch.no_grad():
        if backend is LinearBackend.ONEDNN_PACKED:
            return pack_weight(weight)
        if backend is LinearBackend.PANELS:
            return panel_kernels().pack_panels(weight.detach())
        if backend is LinearBackend.PANELS_INT8:
            q, scale = quantize_int8(weight)
            return panel_kernels().pack_panels(q), scale
    raise ValueError(f"{backend} multiplies the weight as loaded")


def run_packed(
    backend: LinearBackend, x: torch.Tensor, packed: Packed, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    fn, args = bind(backend, None, packed, bias, out_features)
    return fn(x, *args)


BoundLinear = tuple[Callable[..., torch.Tensor], tuple]  # fn(x, *args) = the linear of x


def bind(
    backend: LinearBackend, weight: torch.Tensor | None, packed: Packed | None, bias: torch.Tensor | None, out_features: int
) -> BoundLinear:
    """`backend`'s matmul as a function and the arguments after x, resolved once: a call is then
    `fn(x, *args)`, with no lookup of the kernel module or the backend (the decode forward runs
    64 of them per step). `weight` serves TORCH, `packed` the others."""
    if backend is LinearBackend.TORCH:
        return F.linear, (weight, bias)
    if backend is LinearBackend.PANELS:
        return panel_kernels().panel_linear, (packed, out_features, bias)
    if backend is LinearBackend.PANELS_INT8:
        panels, scale = packed
        return panel_kernels().panel_linear, (panels, out_features, bias, scale)
    return packed_linear, (packed, bias)
