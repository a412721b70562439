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

from pathlib import Path

from workers.model import cpp_build

NAME = "hybridserve_panel_gemm"
SOURCE = Path(__file__).resolve().parent / "csrc" / "panel_gemm.cpp"


# Calling it builds the module once per process (or finds it built): the module, or None.
panel_kernels = cpp_build.CpuExtension(NAME, SOURCE, "F.linear and oneDNN only")
build_failure = panel_kernels.failure  # why panel_kernels() returned None, if it did
