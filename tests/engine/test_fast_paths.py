"""The fused decode kernels against the pure-torch reference path beside them.

Kernel level: the Mamba conv + recurrence step, the paged decode attention and the norms on random
caches, with slots and blocks out of order, GQA/MQA, context lengths on block boundaries;
outputs close, states updated in place at exactly the sequences' slots, other slots
untouched. Engine level: the same requests through an engine on the fused kernels and one
on the reference path give the same greedy tokens and logits within tolerance, while
requests finish at different times (so running slots are not contiguous).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import (
    LogitRecorder,
    assert_logits_close,
    new_engine,
    our_logits,
    prompt_of,
    random_mamba_mixer,
    run_engine,
)
from tests.families import ARCHS
from workers.kernels import cpp_build
from workers.kernels import extensions
from workers.kernels.extensions import decode_kernels, scan_kernels
from workers.kernels.fast_path import REFERENCE, FastPath
from workers.model.attention import Attention
from workers.model.config import AttentionShape
from workers.model.config import MlpKind
from workers.model.forward_batch import DecodeGroup, ForwardBatch
from workers.model.layers import MLP, GatedGroupRMSNorm, RMSNorm
from workers.model.ssd import chunked_scan, chunked_scan_grouped
from workers.sampling import SamplingParams

KERNELS = decode_kernels()
FUSED = FastPath(on=True, decode=KERNELS)
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"kernels did not build: {decode_kernels.failure()}")


@pytest.mark.parametrize("groups,dt_max", [(1, float("inf")), (4, 0.3)])
def test_mamba_decode_kernels_equal_reference(groups, dt_max):
    """One kernel from the in_proj rows (read with a row stride, as a view) to y, and to the
    gated norm of y: equal to the reference's y and `mixer.norm(y, gate)`."""
    mixer = random_mamba_mixer(groups=groups, dt_max=dt_max, seed=groups)
    s = mixer.shape
    slots = torch.tensor([7, 2, 5])  # out of order, not a run
    conv = torch.randn(9, s.conv_dim, s.d_conv - 1)
    ssm = torch.randn(9, s.n_heads, s.head_dim, s.d_state)
    zxbcdt = (torch.randn(3, s.in_proj_dim + 5) * 3)[:, 2 : 2 + s.in_proj_dim]  # rows strided
    zxbcdt[:, -s.n_heads :] *= 3  # softplus on both sides of 20
    zxbcdt[0, -s.n_heads] = 25.0
    zxbcdt[1, s.intermediate] = -120.0  # silu far out on both sides
    zxbcdt[2, 0] = 95.0
    group = DecodeGroup(torch.arange(3), torch.zeros(3, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long), slots)
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    ref = mixer._decode(zxbcdt, ref_conv, ref_ssm, group)
    ref_normed = mixer.norm(ref, zxbcdt[:, : s.intermediate])
    mixer.fast = FUSED
    for norm, expected in ((False, ref), (True, ref_normed)):
        conv_k, ssm_k = conv.clone(), ssm.clone()
        out = mixer._decode_fused(zxbcdt, conv_k, ssm_k, group, norm=norm)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ssm_k, ref_ssm, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv_k, ref_conv, rtol=0, atol=0)  # a shift and a copy: exact
    others = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(ssm_k[others], ssm[others]) and not torch.equal(ssm_k[slots], ssm[slots])


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (8, 2), (4, 1), (6, 2)])
def test_paged_decode_attention_equals_reference(n_heads, n_kv_heads):
    torch.manual_seed(n_heads * 10 + n_kv_heads)
    head_dim, block_size = 16, 4
    shape = AttentionShape(n_heads, n_kv_heads, head_dim, 0, 0.0, head_dim**-0.5, False)
    attn = Attention(32, shape)
    kv_cache = torch.randn(2, 20, block_size, n_kv_heads, head_dim)
    context_lens = torch.tensor([0, 3, 4, 9, 15])  # the token itself at position context_len is visible
    width = 4
    tables = torch.stack([torch.randperm(19)[:width] + 1 for _ in context_lens])  # blocks out of order
    group = DecodeGroup(torch.arange(5), context_lens, tables, torch.arange(5))
    batch = ForwardBatch(torch.zeros(5, dtype=torch.long), context_lens, torch.zeros(5, dtype=torch.long), (), group)
    q = torch.randn(5, n_heads, head_dim)
    ref = attn._decode(q, kv_cache, batch)
    attn.fast = FUSED
    torch.testing.assert_close(attn._decode_paged(q, kv_cache, batch), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim",
    [(8, 2, 64), (8, 1, 20), (6, 2, 12), (8, 2, 24), (8, 4, 16), (6, 1, 16), (8, 1, 16), (4, 2, 4)],
)
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("batch_size,threads", [(1, 2), (5, 2), (6, 2), (6, 1)])
def test_paged_decode_attention_over_many_key_chunks_equals_reference(
    n_heads, n_kv_heads, head_dim, block_size, batch_size, threads
):
    """Histories of several 64-key chunks, chunks starting inside blocks (block size 5), the
    running maximum growing in a late chunk (sequence 0) or set in the first (sequence 1);
    query heads per kv head 1-8 with and without a remainder after groups of four, head sizes
    with and without a part vector; a task per kv head (1 or 5 sequences on 2 threads) and per
    sequence (6 on 2 threads, 6 on 1)."""
    torch.manual_seed(n_heads + head_dim + batch_size + block_size)
    shape = AttentionShape(n_heads, n_kv_heads, head_dim, 0, 0.0, head_dim**-0.5, False)
    attn = Attention(32, shape)
    kv_cache = torch.randn(2, 90, block_size, n_kv_heads, head_dim)
    context_lens = torch.tensor([200, 140, 63, 64, 65, 0][:batch_size])  # keys: context_len + 1
    width = -(-201 // block_size)
    tables = torch.stack([torch.randperm(89)[:width] + 1 for _ in context_lens])
    kv_cache[0, tables[0, 150 // block_size :]] *= 4  # sequence 0's largest scores come late
    if batch_size > 1:
        kv_cache[0, tables[1, 0]] *= 6  # sequence 1's come first and are never beaten
    group = DecodeGroup(torch.arange(batch_size), context_lens, tables, torch.arange(batch_size))
    batch = ForwardBatch(
        torch.zeros(batch_size, dtype=torch.long), context_lens, torch.zeros(batch_size, dtype=torch.long), (), group
    )
    q = torch.randn(batch_size, n_heads, head_dim) * 2
    ref = attn._decode(q, kv_cache, batch)
    attn.fast = FUSED
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attn._decode_paged(q, kv_cache, batch)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_rejects_what_would_read_outside_the_cache():
    """A history longer than its block table, a block the cache does not have, or query heads
    not a multiple of the kv heads: an error naming it, never a read past the cache."""
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 8).unbind(0)
    q, tables = torch.randn(1, 4, 8), torch.tensor([[1, 2]])
    with pytest.raises(RuntimeError, match="beyond its block table"):
        KERNELS.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="names block 6 of 6"):
        KERNELS.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[1, 6]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        KERNELS.paged_decode_attention(torch.randn(1, 3, 8), k_cache, v_cache, tables, torch.tensor([5]), 1.0)
    out = KERNELS.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([8]), 1.0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 2), (4, 1)])
@pytest.mark.parametrize("batch_size", [1, 4])  # one thread: a task per kv head, then per sequence
def test_paged_decode_attention_writes_this_steps_kv(n_heads, n_kv_heads, batch_size):
    """The fused decode step writes each sequence's new K/V (views of the qkv rows) at its slot,
    then attends over it: same cache bytes and outputs as the reference's write-then-attend."""
    torch.manual_seed(n_heads)
    head_dim, block_size, width = 16, 16, 9
    shape = AttentionShape(n_heads, n_kv_heads, head_dim, 0, 0.0, head_dim**-0.5, False)
    attn = Attention(32, shape)
    kv_cache = torch.randn(2, 40, block_size, n_kv_heads, head_dim) * 2
    context_lens = torch.tensor([130, 0, 4, 9][:batch_size])  # 130: beyond two 64-key chunks
    # out of order; a written block is its sequence's own
    tables = (torch.randperm(39)[: batch_size * width] + 1).view(batch_size, width)
    rows = torch.arange(batch_size)
    slots = tables[rows, context_lens // block_size] * block_size + context_lens % block_size
    group = DecodeGroup(rows, context_lens, tables, rows, covers_batch=True)
    batch = ForwardBatch(torch.zeros(batch_size, dtype=torch.long), context_lens, slots, (), group)
    qkv = torch.randn(batch_size, (n_heads + 2 * n_kv_heads) * head_dim) * 3
    widths = [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim]
    q, k, v = (t.view(batch_size, -1, head_dim) for t in qkv.split(widths, -1))
    ref_cache = kv_cache.clone()
    ref_cache[0].view(-1, n_kv_heads, head_dim)[slots] = k
    ref_cache[1].view(-1, n_kv_heads, head_dim)[slots] = v
    ref = attn._decode(q, ref_cache, batch)
    attn.fast = FUSED
    out = attn._decode_paged(q, kv_cache, batch, k, v)
    assert torch.equal(kv_cache, ref_cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_residual_norm_and_mlp_activation_kernels_equal_reference():
    """`RMSNorm.residual` (add in place, then the norm) and both MLP activations, fused vs reference."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    h, delta = torch.randn(5, 64) * 3, torch.randn(5, 64)
    for alpha in (1.0, 0.22):
        ref_h, ref_x = norm.residual(h.clone(), delta, alpha)
        norm.fast = FUSED
        fused_h = h.clone()
        out_h, out_x = norm.residual(fused_h, delta, alpha)
        norm.fast = REFERENCE
        assert out_h is fused_h  # the stream is updated in place
        torch.testing.assert_close(out_h, ref_h, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out_x, ref_x, rtol=1e-5, atol=1e-5)
    for kind in MlpKind:
        mlp = MLP(kind, 32, 48, bias=False)
        x = torch.randn(6, 32) * 4
        x[0, :] = 60.0  # silu and relu far out on both sides
        x[1, :] = -60.0
        with torch.inference_mode():
            ref = mlp(x)
            mlp.fast = FUSED
            torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-4)


@ARCHS
def test_fused_decode_equals_reference_logits(tiny, arch):
    """Prefill 20 then decode one token at a time: every position's logits, fused vs reference."""
    model = tiny[arch].ours
    ids = prompt_of(36, seed=4)
    split = [20] + [1] * 16
    assert_logits_close(our_logits(model, ids, split), our_logits(model, ids, split, fast_kernels=False))


def _reference_engine(path):
    engine = new_engine(path)
    engine.runner.set_fast_kernels(False)
    return engine


@ARCHS
def test_engine_fused_equals_reference_with_scattered_slots(tiny, arch):
    """Requests of different lengths finish at different steps, so the running slots have holes;
    greedy tokens equal and sampled logits close on both paths."""
    prompts = {f"r{i}": prompt_of(5 + 7 * i, seed=i) for i in range(6)}
    params = {rid: SamplingParams(max_tokens=3 + 4 * (i % 3), temperature=0.0, ignore_eos=True)
              for i, rid in enumerate(prompts)}  # fmt: skip
    runs, recorders, slot_runs = [], [], []
    for make in (lambda p: new_engine(p), _reference_engine):
        engine = make(tiny[arch].path)
        recorders.append(LogitRecorder(engine))
        inner = engine.runner._decode_group

        def decode_group(rows, chunks, covers_batch, inner=inner):
            group = inner(rows, chunks, covers_batch)
            if group is not None:
                slot_runs.append(group.slot_run)
            return group

        engine.runner._decode_group = decode_group
        runs.append(run_engine(engine, prompts, params))
    assert None in slot_runs, "no step decoded scattered slots"
    assert runs[0].tokens == runs[1].tokens
    for rid in prompts:
        assert_logits_close(recorders[0].stacked(rid), recorders[1].stacked(rid))


@ARCHS
def test_fresh_slots_are_never_read_before_written(tiny, arch):
    """Fresh prompts are not given zeroed Mamba slots (the first prefill segment starts from
    zeros itself): with every slot full of NaN beforehand, both paths still give a clean
    engine's tokens and logits, prompts chunked over several steps and short ones included."""
    prompts = {f"r{i}": prompt_of(n, seed=i) for i, n in enumerate([1, 3, 40, 70])}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    clean = new_engine(tiny[arch].path, max_num_batched_tokens=48)
    clean_recorder = LogitRecorder(clean)
    expected = run_engine(clean, prompts, params)
    for fast in (True, False):
        engine = new_engine(tiny[arch].path, max_num_batched_tokens=48)
        if not fast:
            engine.runner.set_fast_kernels(False)
        for conv, ssm in zip(engine.runner.caches.conv, engine.runner.caches.ssm):
            conv.fill_(float("nan"))
            ssm.fill_(float("nan"))
        recorder = LogitRecorder(engine)
        run = run_engine(engine, prompts, params)
        assert run.tokens == expected.tokens
        for rid in prompts:
            assert_logits_close(recorder.stacked(rid), clean_recorder.stacked(rid))


def test_reference_path_when_kernels_cannot_build(monkeypatch):
    """No compiler on the machine: None with a reason, and the runner falls back to the reference."""
    monkeypatch.setattr(cpp_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpp_build, "_put_pip_ninja_on_path", lambda: None)
    monkeypatch.setattr(cpp_build, "_failures", {})
    assert decode_kernels.build() is None
    assert "ninja" in decode_kernels.failure()
    assert scan_kernels.failure() is None  # each module fails on its own
    assert scan_kernels.build() is None
    assert "ninja" in scan_kernels.failure()


def test_the_build_folder_follows_every_source_and_the_headers_beside_them(tmp_path):
    """The kernel sources include `vector_math.h`, and a module may have several: editing any of
    its sources or a header must give a new build folder, or a machine with the old build cached
    would keep running the old code."""
    sources = (tmp_path / "kernel.cpp", tmp_path / "more.cpp")
    sources[0].write_text('#include "shared.h"\n')
    sources[1].write_text('#include "shared.h"\nint g() { return 1; }\n')
    (tmp_path / "shared.h").write_text("inline int f() { return 1; }\n")
    folders = {cpp_build.build_dir("k", sources)}
    assert cpp_build.build_dir("k", sources) in folders
    (tmp_path / "shared.h").write_text("inline int f() { return 2; }\n")
    folders.add(cpp_build.build_dir("k", sources))
    sources[1].write_text('#include "shared.h"\nint g() { return 2; }\n')
    folders.add(cpp_build.build_dir("k", sources))
    assert len(folders) == 3
    assert cpp_build.build_dir("k", sources[:1]) not in folders  # a module of fewer sources
    assert (extensions.CSRC / "vector_math.h").exists()  # what the real sources include


def test_two_checkouts_of_the_same_sources_build_from_one_copy(tmp_path):
    """Torch's build file names its sources by absolute path: a second checkout (a worktree,
    CI's fresh clone) sharing the build folder would rewrite it and rebuild every time. The
    build compiles copies inside its folder instead, written once: the same paths, untouched."""
    checkouts = [tmp_path / "one" / "csrc", tmp_path / "two" / "csrc"]
    for checkout in checkouts:
        checkout.mkdir(parents=True)
        (checkout / "kernel.cpp").write_text('#include "shared.h"\n')
        (checkout / "shared.h").write_text("inline int f() { return 1; }\n")
    out = tmp_path / "build"
    first = cpp_build._sources_in(out, (checkouts[0] / "kernel.cpp",))
    written = [(p, p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()]
    second = cpp_build._sources_in(out, (checkouts[1] / "kernel.cpp",))
    assert first == second and first[0].is_relative_to(out)
    assert (first[0].parent / "shared.h").read_text() == "inline int f() { return 1; }\n"
    assert [(p, p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()] == written
    for ext in (extensions.decode_kernels, extensions.scan_kernels, extensions.panel_kernels):
        assert all(s.parent == extensions.CSRC and s.exists() for s in ext.sources)


def test_a_build_killed_midway_does_not_block_later_loads():
    """A process killed while it built a kernel leaves torch's lock file in the build folder;
    the next process must clear it and load the module, not wait for it forever (a replica
    stopped during its first start-up would otherwise hang every later one)."""
    ext = decode_kernels
    out = cpp_build.build_dir(ext.name, ext.sources, ext.flags)
    assert ext() is not None and out.is_dir()
    (out / "lock").touch()
    root = Path(__file__).resolve().parents[2]
    code = "from workers.kernels.extensions import decode_kernels; assert decode_kernels() is not None"
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root, env=env)
    assert not (out / "lock").exists()


@pytest.mark.parametrize("groups", [1, 4])
def test_norm_kernels_equal_reference(groups):
    torch.manual_seed(groups)
    x, gate = torch.randn(5, 64) * 3, torch.randn(5, 64)
    plain, gated = RMSNorm(64, 1e-6), GatedGroupRMSNorm(64, groups, 1e-6)
    for norm in (plain, gated):
        norm.weight.data = torch.randn(64)
    refs = plain(x), gated(x, gate)
    plain.fast = gated.fast = FUSED
    torch.testing.assert_close(plain(x), refs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gated(x, gate), refs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "b,length,h,p,g,n,chunk",
    [(2, 37, 8, 4, 2, 6, 16), (1, 5, 4, 8, 4, 3, 8), (2, 70, 8, 16, 1, 16, 32), (3, 64, 6, 4, 3, 5, 64)],
)
def test_grouped_scan_equals_reference_scan(b, length, h, p, g, n, chunk):
    """Padding, several chunks, one chunk, groups of 1..4 heads, a non-zero initial state."""
    torch.manual_seed(length)
    x, dt, A = torch.randn(b, length, h, p), torch.rand(b, length, h), -torch.rand(h) * 2
    B, C, s0 = torch.randn(b, length, g, n), torch.randn(b, length, g, n), torch.randn(b, h, p, n)
    y_ref, final_ref = chunked_scan(x, dt, A, B, C, chunk, s0)
    y, final = chunked_scan_grouped(x, dt, A, B, C, chunk, s0)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, final_ref, rtol=1e-5, atol=1e-5)
