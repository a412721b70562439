"""What the model runs instead of its pure-torch reference: one typed holder, set by the runner.

    on       the fast variants that need no compiler: split prefill attention after cached
             history (two flash passes, `Attention._prefill_split`) and, when `scan` is None,
             the grouped SSD scan (`ssd.chunked_scan_grouped`)
    decode   csrc/decode_kernels.cpp + paged_attention.cpp (`extensions.decode_kernels()`): decode
             mixers, paged decode attention, norms; None runs their references
    scan     csrc/ssd_scan.cpp (`extensions.scan_kernels()`): the Mamba prefill (conv + recurrence
             on the flat rows, states in place), the Mamba output norm, the MLP activations

The runner builds both kernel modules when it turns the fast path on (start-up), so the model
forward never compiles anything; either may be None (no compiler here) without affecting the
other or the pure-torch variants.

All of it is CPU code (C++ kernels, `_scaled_dot_product_flash_attention_for_cpu`, packed
panels measured on this CPU): an engine on any other device runs the pure-torch reference,
which is device-generic (`runs_fast_path`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class FastPath:
    on: bool
    decode: ModuleType | None = None
    scan: ModuleType | None = None

    def __post_init__(self) -> None:
        if not self.on and (self.decode is not None or self.scan is not None):
            raise ValueError("kernels given for the reference path (on=False)")


REFERENCE = FastPath(on=False)


def runs_fast_path(device: str | torch.device, enabled: bool = True) -> bool:
    """Whether an engine on `device` runs the fast path (asked for with `enabled`): on the CPU
    only; on CUDA the reference path runs (cuBLAS, SDPA and the chunked SSD scan on the GPU)."""
    return enabled and torch.device(device).type == "cpu"
