"""The Mamba2 prefill kernels (`csrc/ssd_scan.cpp`), built from source at start-up.

Built by `cpp_build.build_cpu_extension` like the decode kernels, as its own module so that
each kernel file builds, and fails, on its own. The runner asks for it when it turns the fast
path on, never the model forward. When it cannot be built, `scan_kernels()` returns None and
the fast path's prefill runs the pure-torch grouped SSD scan (`ssd.chunked_scan_grouped`) and
the Mamba output norm the decode kernels' (or torch's), the MLP activations torch's.

    ext = scan_kernels()            # the module, or None (reason in `build_failure()`)
    y, final = ext.recurrent_scan(x, dt, A, B, C, initial_state, lengths)   # see ssd.recurrent_scan
    out = ext.prefill_conv(xbc, conv_cache, starts, counts, slots, weight, bias[, fresh])   # conv + silu rows
    ext.prefill_scan(out, dt_raw, dt_bias, A, D, ssm_cache, starts, counts, slots, dt_min, dt_max, y[, fresh])
                                    # (both: MambaMixer._prefill_fused; states updated in place;
                                    #  fresh [k] bool: the segment starts from zeros, slot not read)
    ext.gated_rms_norm(x, gate, weight, group_size, eps)
"""

from __future__ import annotations

from pathlib import Path

from workers.model import cpp_build

NAME = "hybridserve_ssd_scan"
SOURCE = Path(__file__).resolve().parent / "csrc" / "ssd_scan.cpp"


# Calling it builds the module once per process (or finds it built): the module, or None.
scan_kernels = cpp_build.CpuExtension(NAME, SOURCE, "the pure-torch grouped SSD scan")
build_failure = scan_kernels.failure  # why scan_kernels() returned None, if it did
