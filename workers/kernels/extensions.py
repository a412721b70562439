"""The C++ kernel modules (`csrc/`), each built from source at start-up: the one loader.

Each is a `cpp_build.CpuExtension`: calling it builds the module once per process with the
machine's own compiler (or finds it built, cached per CPU, torch version, flags, sources and
headers) and returns it, or None when it cannot be built here (no compiler, no ninja), the
reason in `.failure()`. Each module builds, and fails, on its own. The runner asks for them
when it turns the fast path on, never the model forward; without one, what it serves runs its
pure-torch reference (named as each module's fallback below), which the tests compare against.

    decode_kernels()    csrc/decode_kernels.cpp + csrc/paged_attention.cpp: the decode step
      .mamba_decode(zxbcdt, conv_cache, ssm_cache, slots, conv_w, conv_b, dt_bias, A, D,
                    dt_min, dt_max, norm_w | empty, norm_group, eps)   -> [B, I] (normed with norm_w)
      .paged_decode_attention(q, k_cache, v_cache, block_tables, num_keys, scale
                              [, k_new, v_new, kv_slots])              -> [B, Hq, d]
      .rms_norm(x, weight, gate | None, group_size, eps)               -> [.., size]
      .add_rms_norm(h, delta, alpha, weight, eps)   -> norm(h += alpha * delta), h in place
      .mlp_activation(up, gated)                    -> silu(gate) * up | relu(up)^2 (in place)

    scan_kernels()      csrc/ssd_scan.cpp: the Mamba2 prefill
      .recurrent_scan(x, dt, A, B, C, initial_state, lengths) -> (y, final)   (see ssd.recurrent_scan)
      .prefill_conv(xbc, conv_cache, starts, counts, slots, weight, bias[, fresh])  -> conv + silu rows
      .prefill_scan(out, dt_raw, dt_bias, A, D, ssm_cache, starts, counts, slots, dt_min, dt_max, y[, fresh])
                        (both: MambaMixer._prefill_fused; states updated in place;
                         fresh [k] bool: the segment starts from zeros, slot not read)
      .gated_rms_norm(x, gate, weight, group_size, eps)

    panel_kernels()     csrc/panel_gemm.cpp: the weight matmuls on packed panels
      .pack_panels(weight)                    [N, K] -> [ceil(N/16), K, 16], a copy
      .panel_linear(x, panels, N, bias[, scale])   x [..., K] -> [..., N], = F.linear within fp32 rounding
"""

from __future__ import annotations

from pathlib import Path

from workers.kernels.cpp_build import CpuExtension

CSRC = Path(__file__).resolve().parent / "csrc"

# Floating-point operations never trap here (no FP exceptions are enabled); saying so lets the
# compiler turn the selects in fast_exp into vector blends, so the activation, norm and softmax
# loops vectorise. A flag, not `#pragma GCC optimize`: functions under the pragma do not inline
# the standard library's (std::max, std::min ... became calls in the inner loops).
decode_kernels = CpuExtension(
    "hybridserve_decode_kernels",
    (CSRC / "decode_kernels.cpp", CSRC / "paged_attention.cpp"),
    "the pure-torch decode path",
    flags=("-fno-trapping-math",),
)
scan_kernels = CpuExtension("hybridserve_ssd_scan", (CSRC / "ssd_scan.cpp",), "the pure-torch grouped SSD scan")
panel_kernels = CpuExtension("hybridserve_panel_gemm", (CSRC / "panel_gemm.cpp",), "F.linear and oneDNN only")
