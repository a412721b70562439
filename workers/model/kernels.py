"""The fused CPU decode kernels (`csrc/decode_kernels.cpp`), built from source at start-up.

Built by `cpp_build.build_cpu_extension` (the machine's own compiler, cached per CPU, torch
version, flags and source). The runner asks for them when it turns the fast path on, never the model
forward. When the build cannot happen (no compiler, no ninja), `decode_kernels()` returns None
and the decode mixers, decode attention and norms run their pure-torch references, which are
always there and which the tests compare against.

    kernels = decode_kernels()          # the module, or None (reason in `build_failure()`)
    kernels.mamba_decode(zxbcdt, conv_cache, ssm_cache, slots, conv_w, conv_b, dt_bias, A, D,
                         dt_min, dt_max, norm_w | empty, norm_group, eps)  -> [B, I] (normed with norm_w)
    kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, num_keys, scale
                                   [, k_new, v_new, kv_slots])              -> [B, Hq, d]
    kernels.rms_norm(x, weight, gate | None, group_size, eps)               -> [.., size]
    kernels.add_rms_norm(h, delta, alpha, weight, eps)  -> norm(h += alpha * delta), h in place
    kernels.mlp_activation(up, gated)                   -> silu(gate) * up | relu(up)^2 (in place)
"""

from __future__ import annotations

from pathlib import Path

from workers.model import cpp_build

NAME = "hybridserve_decode_kernels"
SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_kernels.cpp"


# Calling it builds the module once per process (or finds it built): the module, or None.
# Floating-point operations never trap here (no FP exceptions are enabled); saying so lets the
# compiler turn the selects in fast_exp into vector blends, so the activation, norm and softmax
# loops vectorise. A flag, not `#pragma GCC optimize`: functions under the pragma do not inline
# the standard library's (std::max, std::min ... became calls in the inner loops).
decode_kernels = cpp_build.CpuExtension(NAME, SOURCE, "the pure-torch decode path", flags=("-fno-trapping-math",))
build_failure = decode_kernels.failure  # why decode_kernels() returned None, if it did
