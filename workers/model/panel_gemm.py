"""The few-row weight matmul kernel (`csrc/panel_gemm.cpp`), built from source at start-up.

Built by `cpp_build.build_cpu_extension` like the other kernels, as its own module. The linear
tuning (`linear_tuning.tune_linears`, run when the fast path is turned on) asks for it and
times it beside F.linear and oneDNN; when it cannot be built, `panel_kernels()` returns None and
the tuning chooses among the other two.

    ext = panel_kernels()                       # the module, or None (reason in `build_failure()`)
    panels = ext.pack_panels(weight)            # [N, K] -> [ceil(N/16), K, 16], a copy
    y = ext.panel_linear(x, panels, N, bias)    # x [..., K] -> [..., N], = F.linear within fp32 rounding
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from workers.model import cpp_build

NAME = "hybridserve_panel_gemm"
SOURCE = Path(__file__).resolve().parent / "csrc" / "panel_gemm.cpp"


@functools.cache
def panel_kernels() -> ModuleType | None:
    """The compiled kernel, or None when it cannot be built here (logged once)."""
    return cpp_build.build_cpu_extension(NAME, SOURCE, "F.linear and oneDNN only")


def build_failure() -> str | None:
    """Why `panel_kernels()` returned None, if it did."""
    return cpp_build.build_failure(NAME)
