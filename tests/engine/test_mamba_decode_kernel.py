"""The Mamba decode kernel (`mamba_decode` in csrc/decode_kernels.cpp) beyond the shapes of
test_fast_paths: state widths that are not a multiple of the 8 vector lanes (the scalar tail of
each state row), and the invariance a per-(sequence, head) kernel owes: a sequence's output and
new state do not depend on which other sequences share the batch, where it sits in it, or how
many threads step it (the kernel prefetches the state of whatever head a thread steps next).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import random_mamba_mixer
from workers.kernels.extensions import decode_kernels
from workers.kernels.fast_path import FastPath
from workers.model.forward_batch import DecodeGroup

KERNELS = decode_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"kernels did not build: {decode_kernels.failure()}")


def _group(slots: list[int]) -> DecodeGroup:
    n = len(slots)
    return DecodeGroup(torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, 1, dtype=torch.long), torch.tensor(slots))


def _inputs(mixer, slots: int, rows: int, seed: int):
    s = mixer.shape
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(slots, s.conv_dim, s.d_conv - 1, generator=g)
    ssm = torch.randn(slots, s.n_heads, s.head_dim, s.d_state, generator=g)
    zxbcdt = torch.randn(rows, s.in_proj_dim, generator=g) * 2
    return conv, ssm, zxbcdt


@pytest.mark.parametrize("d_state,head_dim", [(12, 16), (5, 6), (36, 3)])
def test_state_rows_with_a_scalar_tail_equal_reference(d_state, head_dim):
    """d_state % 8 != 0 (and < 8): the elements past the last full vector, and the norm after."""
    mixer = random_mamba_mixer(groups=2, dt_max=float("inf"), seed=d_state, head_dim=head_dim, d_state=d_state)
    s = mixer.shape
    conv, ssm, zxbcdt = _inputs(mixer, 6, 3, d_state)
    group = _group([4, 0, 2])
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    ref = mixer.norm(mixer._decode(zxbcdt, ref_conv, ref_ssm, group), zxbcdt[:, : s.intermediate])
    mixer.fast = FastPath(on=True, decode=KERNELS)
    out = mixer._decode_fused(zxbcdt, conv, ssm, group, norm=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv, ref_conv)
    assert torch.equal(ssm[[1, 3, 5]], ref_ssm[[1, 3, 5]])  # slots outside the batch untouched


def test_output_and_state_do_not_depend_on_the_batch_or_threads():
    """Each sequence stepped alone on one thread, then all 9 in one batch of scattered slots on two
    threads (each thread steps several heads and prefetches across slots; the conv's channels
    split between the threads in the middle of a row): the same bits for every output row and
    every sequence's conv and SSM state; the slots outside the batch untouched."""
    mixer = random_mamba_mixer(groups=2, dt_max=float("inf"), seed=7, head_dim=16, d_state=32)
    mixer.fast = FastPath(on=True, decode=KERNELS)
    conv, ssm, zxbcdt = _inputs(mixer, 14, 9, 7)
    slots = [9, 0, 11, 5, 2, 7, 3, 13, 1]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = []
        for row, slot in enumerate(slots):
            c, s = conv.clone(), ssm.clone()
            out = mixer._decode_fused(zxbcdt[row : row + 1], c, s, _group([slot]), norm=True)
            alone.append((out[0], c[slot], s[slot]))
        torch.set_num_threads(2)
        batch_conv, batch_ssm = conv.clone(), ssm.clone()
        out = mixer._decode_fused(zxbcdt, batch_conv, batch_ssm, _group(slots), norm=True)
    finally:
        torch.set_num_threads(threads)
    for row, slot in enumerate(slots):
        y, c, s = alone[row]
        assert torch.equal(out[row], y) and torch.equal(batch_conv[slot], c) and torch.equal(batch_ssm[slot], s), row
    outside = [4, 6, 8, 10, 12]
    assert torch.equal(batch_ssm[outside], ssm[outside]) and torch.equal(batch_conv[outside], conv[outside])
