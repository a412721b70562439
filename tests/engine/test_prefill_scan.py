"""The prefill scan kernel (`ssd.recurrent_scan`, C++ recurrence) against the pure-torch references.

Two references: the SSD formulation (`chunked_scan`, what the reference engine runs) and the
definition itself, `recurrent_step` applied token by token. Shapes cover head dims that are
not a multiple of the kernel's 4-row unroll, groups of 1..4 heads, several sequences, a
non-zero initial state, and rows of a padded wave that stop at their own lengths. The engine
level (fast engine == reference engine == transformers) runs in test_fast_paths.py and
test_model_vs_transformers.py, whose prefills now go through this kernel.
"""

from __future__ import annotations

import pytest
import torch

from workers.kernels.extensions import scan_kernels
from workers.model.ssd import chunked_scan, recurrent_scan, recurrent_step

KERNEL = scan_kernels()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"scan kernel did not build: {scan_kernels.failure()}")

SHAPES = pytest.mark.parametrize(
    "b,length,h,p,g,n",
    [(2, 37, 8, 4, 2, 6), (1, 5, 4, 7, 4, 3), (2, 70, 8, 16, 1, 16), (3, 64, 6, 6, 3, 5), (1, 300, 4, 64, 2, 128)],
)


def _inputs(b, length, h, p, g, n):
    torch.manual_seed(length * 31 + p)
    x, dt, A = torch.randn(b, length, h, p), torch.rand(b, length, h), -torch.rand(h) * 2
    B, C, s0 = torch.randn(b, length, g, n), torch.randn(b, length, g, n), torch.randn(b, h, p, n)
    return x, dt, A, B, C, s0


@needs_kernel
@SHAPES
def test_recurrent_scan_equals_ssd_reference(b, length, h, p, g, n):
    x, dt, A, B, C, s0 = _inputs(b, length, h, p, g, n)
    before = s0.clone()
    y_ref, final_ref = chunked_scan(x, dt, A, B, C, 16, s0)
    y, final = recurrent_scan(KERNEL, x, dt, A, B, C, s0)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(s0, before)  # the caller's state is read, not written


@needs_kernel
@SHAPES
def test_recurrent_scan_equals_token_by_token_recurrence(b, length, h, p, g, n):
    x, dt, A, B, C, s0 = _inputs(b, length, h, p, g, n)
    state, ys = s0.clone(), []
    for t in range(length):
        ys.append(recurrent_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t]))
    y, final = recurrent_scan(KERNEL, x, dt, A, B, C, s0)
    torch.testing.assert_close(y, torch.stack(ys, dim=1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, state, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize(
    "b,length,h,p,g,n", [(2, 61, 4, 7, 2, 16), (1, 130, 2, 6, 1, 8), (3, 9, 4, 64, 2, 128), (1, 300, 4, 64, 2, 128)]
)
def test_scaled_state_at_extreme_decays_equals_the_float64_recurrence(b, length, h, p, g, n):
    """The kernel keeps a run's state over a running scale and applies the decay only at its
    "direct" tokens (csrc/ssd_scan.cpp): where the scale would leave [e^-20, e^20], and at a
    run's last token. The decays here cross that bound in one token (dt = 30), over tens of
    tokens (dt up to 0.4), or never (dt = 0; head 0 has A = 0), so direct tokens, scaled pairs
    and lone scaled tokens all occur, on rows in blocks of 4, 2 and 1 (p = 7, 6, 64). The
    reference is the definition, token by token, in float64; without decay the state grows
    over the run, so the bound is relative to the largest output (fp32 rounding of the old
    direct-only kernel was within 3e-7 of it here)."""
    x, _, _, B, C, s0 = _inputs(b, length, h, p, g, n)
    dt = torch.rand(b, length, h) * 0.4
    dt[:, 5::11] = 30.0
    dt[:, 7::13] = 0.0
    A = -(torch.rand(h) * 4 + 0.5)
    A[0] = 0.0
    state, ys = s0.double(), []
    for t in range(length):
        ys.append(recurrent_step(state, x[:, t].double(), dt[:, t].double(), A.double(), B[:, t].double(), C[:, t].double()))
    y_ref = torch.stack(ys, dim=1)
    y, final = recurrent_scan(KERNEL, x, dt, A, B, C, s0)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=2e-6 * y_ref.abs().max().item())
    torch.testing.assert_close(final.double(), state, rtol=1e-5, atol=2e-6 * state.abs().max().item())


@needs_kernel
def test_rows_stop_at_their_lengths_as_if_unpadded():
    """The mixer pads shorter runs of a wave to the longest (dt = 0 there): with `lengths` each
    row's final state is its state after its own last token, its outputs equal the unpadded
    run's, and the padding's outputs are 0; without `lengths` the zero-dt padding gives the
    same final state (the fallback's contract)."""
    x, dt, A, B, C, s0 = _inputs(2, 40, 4, 8, 2, 12)
    dt[1, 25:] = 0.0  # sequence 1 has 25 real tokens
    lengths = torch.tensor([40, 25])
    y, final = recurrent_scan(KERNEL, x, dt, A, B, C, s0, lengths=lengths)
    y_short, final_short = recurrent_scan(KERNEL, x[1:, :25], dt[1:, :25], A, B[1:, :25], C[1:, :25], s0[1:])
    torch.testing.assert_close(final[1:], final_short, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y[1:, :25], y_short, rtol=1e-6, atol=1e-6)
    assert not y[1, 25:].any()
    _, final_padded = recurrent_scan(KERNEL, x, dt, A, B, C, s0)
    torch.testing.assert_close(final_padded, final, rtol=1e-6, atol=1e-6)


@needs_kernel
def test_kernel_rejects_non_fp32_or_mismatched_shapes():
    x, dt, A, B, C, s0 = _inputs(1, 8, 4, 4, 2, 4)
    full = torch.tensor([8])
    with pytest.raises(RuntimeError, match="fp32"):
        KERNEL.recurrent_scan(x.double(), dt, A, B, C, s0, full)
    with pytest.raises(RuntimeError, match="initial_state"):
        KERNEL.recurrent_scan(x, dt, A, B, C, s0[:, :2].contiguous(), full)
    with pytest.raises(RuntimeError, match="lengths"):
        KERNEL.recurrent_scan(x, dt, A, B, C, s0, torch.tensor([9]))
