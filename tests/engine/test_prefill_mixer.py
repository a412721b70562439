"""The Mamba mixer's fused prefill (`MambaMixer._prefill_fused`: `prefill_conv` + `prefill_scan`
in csrc/ssd_scan.cpp, on the flat rows) against its pure-torch reference (`_prefill` on the
reference path: padded wave, torch conv1d, the SSD scan).

Segments of one wave have different lengths (shorter than the conv window too), start from
non-zero conv and SSM states, sit at out-of-order slots and rows that are not the batch's
first; the other slots and the rows of no segment must be left as they were. The engine
level (fast engine == reference engine == transformers) runs in test_fast_paths.py and
test_model_vs_transformers.py, whose prefills go through this path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine.conftest import random_mamba_mixer
from workers.kernels.extensions import decode_kernels, scan_kernels
from workers.kernels.fast_path import REFERENCE, FastPath
from workers.model.config import MlpKind
from workers.model.forward_batch import PrefillSegment
from workers.model.layers import MLP, GatedGroupRMSNorm

KERNEL = scan_kernels()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"scan kernel did not build: {scan_kernels.failure()}")

NO_TABLE = torch.zeros(1, dtype=torch.long)  # the mixer never reads block tables


def _run(mixer, fast, in_proj_rows, conv, ssm, segs, num_rows):
    s = mixer.shape
    _, xbc, dt = in_proj_rows.split([s.intermediate, s.conv_dim, s.n_heads], dim=-1)  # strided views, as in forward
    conv, ssm = conv.clone(), ssm.clone()
    y = torch.full((num_rows, s.intermediate), 7.0)
    mixer.fast = fast
    (mixer._prefill_fused if fast.scan is not None else mixer._prefill)(xbc, dt, conv, ssm, segs, y)
    return y, conv, ssm


@pytest.mark.parametrize(
    "head_dim,groups,conv_bias,dt_max",
    [(16, 2, True, float("inf")), (6, 1, False, 0.3), (12, 4, True, 2.0), (64, 8, False, float("inf"))],
)
def test_fused_prefill_equals_reference(head_dim, groups, conv_bias, dt_max):
    mixer = random_mamba_mixer(
        groups=groups, dt_max=dt_max, seed=head_dim + groups, head_dim=head_dim, conv_bias=conv_bias, dt_min=0.01
    )
    s = mixer.shape
    # rows: 3 unused | seg A 40 | 2 unused | seg B 1 | seg C 2 | seg D 17 | 4 unused
    segs = [
        PrefillSegment(3, 40, 0, NO_TABLE, state_slot=5),
        PrefillSegment(45, 1, 9, NO_TABLE, state_slot=0),  # shorter than the conv window
        PrefillSegment(46, 2, 3, NO_TABLE, state_slot=7),
        PrefillSegment(48, 17, 30, NO_TABLE, state_slot=2),
    ]
    rows = 69
    proj = torch.randn(rows, s.in_proj_dim) * 3  # silu and softplus far into both tails
    proj[10, s.intermediate + s.conv_dim] = 30.0  # softplus above its threshold of 20
    conv, ssm = torch.randn(9, s.conv_dim, s.d_conv - 1), torch.randn(9, s.n_heads, s.head_dim, s.d_state)
    y_ref, conv_ref, ssm_ref = _run(mixer, REFERENCE, proj, conv, ssm, segs, rows)
    y, conv_out, ssm_out = _run(mixer, FastPath(on=True, scan=KERNEL), proj, conv, ssm, segs, rows)

    seg_rows = torch.cat([torch.arange(g.token_start, g.token_start + g.num_tokens) for g in segs])
    torch.testing.assert_close(y[seg_rows], y_ref[seg_rows], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ssm_out, ssm_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv_out, conv_ref, rtol=0, atol=0)  # copies of inputs: exact
    untouched = [i for i in range(9) if i not in (5, 0, 7, 2)]
    assert torch.equal(ssm_out[untouched], ssm[untouched]) and torch.equal(conv_out[untouched], conv[untouched])
    other_rows = torch.ones(rows, dtype=torch.bool)
    other_rows[seg_rows] = False
    assert (y[other_rows] == 7.0).all()


@pytest.mark.parametrize("d_state", [24, 20])  # 20: not a multiple of the vector width
def test_fresh_segments_never_read_their_slots(d_state):
    """A sequence's first segment (context_len 0) starts from the zero state on both paths
    whatever its slot holds, so the runner need not zero a fresh slot: garbage in the fresh
    slots gives what zeroed slots give; a continuing segment beside them reads its slot."""
    mixer = random_mamba_mixer(groups=2, dt_max=float("inf"), seed=d_state, head_dim=12, d_state=d_state, dt_min=0.01)
    s = mixer.shape
    # rows: seg A 30 (fresh) | seg B 5 (after 9 cached tokens) | seg C 2 (fresh, shorter than the conv window)
    segs = [
        PrefillSegment(0, 30, 0, NO_TABLE, state_slot=3),
        PrefillSegment(30, 5, 9, NO_TABLE, state_slot=1),
        PrefillSegment(35, 2, 0, NO_TABLE, state_slot=4),
    ]
    proj = torch.randn(37, s.in_proj_dim) * 3
    conv, ssm = torch.randn(6, s.conv_dim, s.d_conv - 1) * 5, torch.randn(6, s.n_heads, s.head_dim, s.d_state) * 5
    zeroed_conv, zeroed_ssm = conv.clone(), ssm.clone()
    zeroed_conv[[3, 4]], zeroed_ssm[[3, 4]] = 0, 0
    y_zero, conv_zero, ssm_zero = _run(mixer, REFERENCE, proj, zeroed_conv, zeroed_ssm, segs, 37)
    for fast in (REFERENCE, FastPath(on=True, scan=KERNEL)):
        y, conv_out, ssm_out = _run(mixer, fast, proj, conv, ssm, segs, 37)
        torch.testing.assert_close(y, y_zero, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ssm_out, ssm_zero, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(conv_out, conv_zero, rtol=0, atol=0)
    # Fresh flags given to the kernels directly, against the slots' own content (no flags).
    _, xbc, dt = proj.split([s.intermediate, s.conv_dim, s.n_heads], dim=-1)
    starts, counts, slots = torch.tensor([0, 30, 35]), torch.tensor([30, 5, 2]), torch.tensor([3, 1, 4])
    c = mixer.constants
    with_flags = KERNEL.prefill_conv(xbc, conv.clone(), starts, counts, slots, c.conv_weight, c.conv_bias, torch.tensor([True, False, True]))
    without = KERNEL.prefill_conv(xbc, zeroed_conv.clone(), starts, counts, slots, c.conv_weight, c.conv_bias)
    torch.testing.assert_close(with_flags, without, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="one fresh flag per segment"):
        KERNEL.prefill_conv(xbc, conv.clone(), starts, counts, slots, c.conv_weight, c.conv_bias, torch.tensor([True]))


def test_fused_conv_silu_matches_torch_at_extremes():
    """The conv output's SiLU (a vectorised exp) against torch's on values from -100 to 100."""
    channels = 37  # not a multiple of the vector width
    xbc = torch.linspace(-100, 100, 50 * channels).reshape(50, channels)
    weight = torch.zeros(channels, 4)
    weight[:, -1] = 1.0  # the conv passes the current input through
    cache = torch.zeros(2, channels, 3)
    one = torch.tensor([0])
    out = KERNEL.prefill_conv(xbc, cache, one, torch.tensor([50]), torch.tensor([1]), weight, torch.empty(0))
    torch.testing.assert_close(out, F.silu(xbc), rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(cache[1], xbc[-3:].T)  # the last three inputs, oldest first
    assert not cache[0].any()


def test_fused_prefill_rejects_shared_slots_and_bad_rows():
    mixer = random_mamba_mixer(groups=2, dt_max=float("inf"), seed=1, dt_min=0.01)
    s, c = mixer.shape, mixer.constants
    xbc, conv = torch.randn(10, s.conv_dim), torch.zeros(4, s.conv_dim, s.d_conv - 1)
    starts, counts = torch.tensor([0, 5]), torch.tensor([5, 5])
    with pytest.raises(RuntimeError, match="distinct slots"):
        KERNEL.prefill_conv(xbc, conv, starts, counts, torch.tensor([1, 1]), c.conv_weight, c.conv_bias)
    with pytest.raises(RuntimeError, match="out of range"):
        KERNEL.prefill_conv(xbc, conv, starts, torch.tensor([5, 6]), torch.tensor([1, 2]), c.conv_weight, c.conv_bias)
    with pytest.raises(RuntimeError, match="slot out of range"):
        KERNEL.prefill_conv(xbc, conv, starts, counts, torch.tensor([1, 4]), c.conv_weight, c.conv_bias)
    with pytest.raises(RuntimeError, match="fp32"):
        KERNEL.prefill_conv(xbc.double(), conv, starts, counts, torch.tensor([1, 2]), c.conv_weight, c.conv_bias)


@pytest.mark.parametrize("kind", [MlpKind.SWIGLU, MlpKind.RELU2])  # up width 37: a vector tail
def test_mlp_fast_activation_equals_reference(kind):
    """The fused activation (`mlp_activation`, at prefill sizes) against the reference MLP,
    with widths that are not a multiple of the vector width and inputs deep in silu's tails."""
    torch.manual_seed(3)
    mlp = MLP(kind, 24, 37, bias=True).requires_grad_(False)
    x = torch.randn(50, 24) * 8
    ref = mlp(x)
    mlp.fast = FastPath(on=True, decode=decode_kernels())
    torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 4])
def test_gated_norm_kernel_equals_reference(groups):
    """`gated_rms_norm` (gate rows strided, read in place) against GatedGroupRMSNorm's reference."""
    torch.manual_seed(groups)
    norm = GatedGroupRMSNorm(40, groups, 1e-5).requires_grad_(False)
    norm.weight.data = torch.randn(40)
    proj = torch.randn(33, 40 + 40 + 5) * 6
    x, gate = torch.randn(33, 40), proj[:, 40:80]  # a column slice of a wider matrix, as in the mixer
    ref = norm(x, gate)
    norm.fast = FastPath(on=True, scan=KERNEL)
    torch.testing.assert_close(norm(x, gate), ref, rtol=1e-5, atol=1e-5)
