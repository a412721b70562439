"""Sequence-mixer kernels, fast path vs the pure-torch reference beside it, on the `bench` shapes.

    python -m bench.kernel_speed [--quick] [--arch granitemoehybrid] [--repeats 7]

Rows:
  prefill scan      `ssd.chunked_scan_grouped` (SSD, the fallback) vs `ssd.recurrent_scan`
                    (C++ recurrence), one Mamba layer, runs of sequences x tokens
  prefill mixer     `MambaMixer._prefill` on the reference path (padded wave, conv1d, SSD scan) vs
                    `MambaMixer._prefill_fused` (prefill_conv + prefill_scan on the flat rows), one
                    Mamba layer between its in_proj and its norm, runs of sequences x tokens
  prefill attention `Attention._prefill` (history + chunk gathered, one masked SDPA) vs
                    `Attention._prefill_split` (history and causal chunk, merged by log-sum-exp),
                    one layer, a chunk of tokens after a history
  decode attention  `Attention._decode` (the batch's K/V gathered, masked SDPA) vs
                    `Attention._decode_paged` (blocks read in place), one layer, batch x history
  decode mixer      `MambaMixer._decode` + its gated norm vs `_decode_fused` (`mamba_decode`: conv,
                    recurrence and norm in one kernel, states in place at scattered slots), every
                    Mamba layer of the model on its own state cache (as a decode step: the states
                    come from memory), batch x 1 token; its SSM state traffic (read + written) in
                    GB/s against two probes of this machine: a read (sum) and an in-place
                    read + write (scale) of 512 MB

Each figure is the minimum over repeats of process CPU time (what the two threads spent, which
a shared machine inflates less than wall time) and of wall time, the two sides alternated.
The largest output difference is recorded beside each row. Writes bench/results/kernels[.quick].{json,md}
(--smoke, tiny shapes in seconds: kernels.smoke.*; --results-dir elsewhere).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.kit.checkpoints import checkpoint_dir
from bench.kit.environment import environment_info
from bench.kit.results import RESULTS_DIR, write_results
from bench.kit.tables import format_number, markdown_table
from workers.checkpoint import Arch, Preset
from workers.kernels.extensions import decode_kernels, scan_kernels
from workers.kernels.fast_path import REFERENCE, FastPath
from workers.model.attention import Attention
from workers.model.config import AttentionShape, HybridModelConfig, MambaShape
from workers.model.forward_batch import DecodeGroup, ForwardBatch, PrefillSegment
from workers.model.loader import read_model_config
from workers.model.mamba_mixer import MambaMixer
from workers.model.ssd import chunked_scan_grouped, recurrent_scan

BLOCK_SIZE = 16
FULL = {
    "scan": [(1, 2048), (8, 128), (1, 8192), (8, 2048)],
    "mixer": [(8, 128), (1, 2048), (8, 512)],
    "prefill_attention": [(2048, 2048), (2048, 6144), (64, 8192)],  # (chunk, history)
    "attention": [(8, 2048), (8, 8192), (1, 8192), (32, 2048)],
    "decode_mixer": [1, 8, 32],
}
QUICK = {
    "scan": [(1, 2048), (8, 128)],
    "mixer": [(8, 128)],
    "prefill_attention": [(2048, 6144)],
    "attention": [(8, 2048), (1, 8192)],
    "decode_mixer": [8],
}
SMOKE = {  # with the tiny checkpoint: proves the benchmark runs, measures nothing
    "scan": [(1, 64)],
    "mixer": [(2, 32)],
    "prefill_attention": [(32, 64)],
    "attention": [(2, 64)],
    "decode_mixer": [2],
}


def _time(sides: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, dict[str, float]]:
    """Min CPU and wall seconds per side, sides alternated within every repeat."""
    best = {name: {"cpu_s": float("inf"), "wall_s": float("inf")} for name in sides}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, fn in sides.items():
                cpu, wall = time.process_time(), time.perf_counter()
                fn()
                best[name]["cpu_s"] = min(best[name]["cpu_s"], time.process_time() - cpu)
                best[name]["wall_s"] = min(best[name]["wall_s"], time.perf_counter() - wall)
    return best


def scan_row(shape: MambaShape, seqs: int, tokens: int, repeats: int, short: int | None = None) -> dict:
    """`short`: a padded wave, as the mixer batches it: row 0 has `tokens`, the others `short`."""
    g = torch.Generator().manual_seed(seqs * tokens)
    h, p, n, groups = shape.n_heads, shape.head_dim, shape.d_state, shape.n_groups
    x = torch.randn(seqs, tokens, h, p, generator=g)
    dt = torch.rand(seqs, tokens, h, generator=g) * 0.1
    A = -torch.rand(h, generator=g) * 4
    B, C = (torch.randn(seqs, tokens, groups, n, generator=g) for _ in range(2))
    s0 = torch.randn(seqs, h, p, n, generator=g)
    lengths = torch.full((seqs,), tokens)
    if short is not None:
        lengths[1:] = short
        dt[1:, short:] = 0.0  # padding, as the mixer fills it
    chunk = min(shape.chunk_size, max(16, 1 << (tokens - 1).bit_length()))  # as the mixer picks it
    kernel = scan_kernels()
    sides = {"reference": lambda: chunked_scan_grouped(x, dt, A, B, C, chunk, s0)}
    if kernel is not None:
        sides["fast"] = lambda: recurrent_scan(kernel, x, dt, A, B, C, s0, lengths=lengths)
    times = _time(sides, repeats)
    err = None
    if "fast" in sides:
        (y_ref, s_ref), (y, s) = sides["reference"](), sides["fast"]()
        real = torch.arange(tokens)[None, :] < lengths[:, None]
        err = max((y - y_ref)[real].abs().max().item(), (s - s_ref).abs().max().item())
    kind = "prefill scan" if short is None else f"prefill scan, padded wave (rows 2.. have {short})"
    return {"kind": kind, "batch": seqs, "tokens": tokens, "max_abs_diff": err, **_sides(times)}


def mixer_row(shape: MambaShape, hidden: int, seqs: int, tokens: int, repeats: int) -> dict:
    """One Mamba layer's prefill from its in_proj rows to y (states from non-zero slots, in place)."""
    torch.manual_seed(seqs * tokens)
    mixer = MambaMixer(hidden, shape, 1e-5).requires_grad_(False)
    for p in mixer.parameters():
        p.data = torch.randn_like(p) * 0.1
    proj = torch.randn(seqs * tokens, shape.in_proj_dim)
    _, xbc, dt = proj.split([shape.intermediate, shape.conv_dim, shape.n_heads], -1)  # strided, as in forward
    segs = [PrefillSegment(i * tokens, tokens, 0, torch.zeros(1, dtype=torch.long), 2 * i + 1) for i in range(seqs)]
    conv = torch.randn(2 * seqs + 1, shape.conv_dim, shape.d_conv - 1)
    ssm = torch.randn(2 * seqs + 1, shape.n_heads, shape.head_dim, shape.d_state) * 0.1
    kernel = scan_kernels()

    def run(fast: FastPath):
        y, c, s = torch.empty(seqs * tokens, shape.intermediate), conv.clone(), ssm.clone()
        mixer.fast = fast
        (mixer._prefill_fused if fast.scan is not None else mixer._prefill)(xbc, dt, c, s, segs, y)
        return y, s

    sides = {"reference": lambda: run(REFERENCE)}
    if kernel is not None:
        sides["fast"] = lambda: run(FastPath(on=True, scan=kernel))
    times = _time(sides, repeats)
    err = None
    if "fast" in sides:
        (y_ref, s_ref), (y, s) = sides["reference"](), sides["fast"]()
        err = max((y - y_ref).abs().max().item(), (s - s_ref).abs().max().item())
    return {"kind": "prefill mixer", "batch": seqs, "tokens": tokens, "max_abs_diff": err, **_sides(times)}


def prefill_attention_row(shape: AttentionShape, chunk: int, history: int, repeats: int) -> dict:
    torch.manual_seed(chunk + history)
    attn = Attention(shape.n_heads * shape.head_dim, shape).requires_grad_(False)
    blocks = -(-(history + chunk) // BLOCK_SIZE)
    kv = torch.randn(2, 1 + blocks, BLOCK_SIZE, shape.n_kv_heads, shape.head_dim)
    table = torch.randperm(blocks) + 1
    pos = torch.arange(history, history + chunk)
    slots = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    q = torch.randn(chunk, shape.n_heads, shape.head_dim)
    k, v = (kv[i].view(-1, shape.n_kv_heads, shape.head_dim)[slots] for i in range(2))
    seg = PrefillSegment(0, chunk, history, table, 0)
    sides = {
        "reference": lambda: attn._prefill(q, k, v, kv, seg),
        "fast": lambda: attn._prefill_split(q, k, v, kv, seg),
    }
    times = _time(sides, repeats)
    err = (sides["fast"]() - sides["reference"]()).abs().max().item()
    return {"kind": "prefill attention", "batch": chunk, "tokens": history, "max_abs_diff": err, **_sides(times)}


def attention_row(shape: AttentionShape, seqs: int, history: int, repeats: int) -> dict:
    torch.manual_seed(seqs + history)
    attn = Attention(shape.n_heads * shape.head_dim, shape).requires_grad_(False)
    attn.fast = FastPath(on=True, decode=decode_kernels())
    width = -(-(history + 1) // BLOCK_SIZE)
    kv = torch.randn(2, 1 + seqs * width, BLOCK_SIZE, shape.n_kv_heads, shape.head_dim)
    order = torch.randperm(seqs * width) + 1  # blocks scattered through the pool, as after churn
    group = DecodeGroup(
        token_index=torch.arange(seqs),
        context_lens=torch.full((seqs,), history),
        block_tables=order.view(seqs, width),
        state_slots=torch.arange(seqs),
        covers_batch=True,
    )
    batch = ForwardBatch(torch.zeros(seqs, dtype=torch.long), group.context_lens, group.context_lens, (), group)
    q = torch.randn(seqs, shape.n_heads, shape.head_dim)
    sides = {"reference": lambda: attn._decode(q, kv, batch)}
    if attn.fast.decode is not None:
        sides["fast"] = lambda: attn._decode_paged(q, kv, batch)
    times = _time(sides, repeats)
    err = (sides["fast"]() - sides["reference"]()).abs().max().item() if "fast" in sides else None
    return {"kind": "decode attention", "batch": seqs, "tokens": history, "max_abs_diff": err, **_sides(times)}


def memory_probes(repeats: int = 5) -> dict[str, float]:
    """GB/s of a streaming read (sum) and of an in-place read + write (scale) of 512 MB: the two
    bounds of a kernel that updates states in place."""
    buffer = torch.randn(128 << 20)
    read = rw = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        buffer.mul_(1.0)
        rw = min(rw, time.perf_counter() - start)
    nbytes = buffer.numel() * 4
    return {"read_gb_s": nbytes / read / 1e9, "read_write_gb_s": 2 * nbytes / rw / 1e9}


def decode_mixer_row(config: HybridModelConfig, seqs: int, repeats: int, probes: dict[str, float]) -> dict:
    """One decode step of every Mamba layer (one mixer's weights, each layer its own caches) from
    the in_proj rows to the gated norm's output, slots scattered through a larger pool."""
    shape, layers = config.mamba, len(config.mamba_layers)
    g = torch.Generator().manual_seed(seqs)
    mixer = MambaMixer(config.hidden_size, shape, 1e-5).requires_grad_(False)
    for p in mixer.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    pool = seqs + seqs // 4 + 1
    caches = [
        (torch.randn(pool, shape.conv_dim, shape.d_conv - 1, generator=g),
         torch.randn(pool, shape.n_heads, shape.head_dim, shape.d_state, generator=g) * 0.1)
        for _ in range(layers)
    ]  # fmt: skip
    slots = torch.randperm(pool, generator=g)[:seqs]
    group = DecodeGroup(torch.arange(seqs), torch.zeros(seqs, dtype=torch.long), torch.zeros(seqs, 1, dtype=torch.long),
                        slots, covers_batch=True)  # fmt: skip
    zxbcdt = torch.randn(seqs, shape.in_proj_dim + 3, generator=g)[:, 1 : 1 + shape.in_proj_dim]  # a strided view
    gate = zxbcdt[:, : shape.intermediate]
    fast = FastPath(on=True, decode=decode_kernels())

    def reference(conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        mixer.fast = REFERENCE
        return mixer.norm(mixer._decode(zxbcdt, conv, ssm, group), gate)

    def fused(conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        mixer.fast = fast
        return mixer._decode_fused(zxbcdt, conv, ssm, group, norm=True)

    sides = {"reference": lambda: [reference(c, s) for c, s in caches]}
    if fast.decode is not None:
        sides["fast"] = lambda: [fused(c, s) for c, s in caches]
    times = _time(sides, repeats)
    row = {"kind": f"decode mixer, {layers} Mamba layers", "batch": seqs, "tokens": 1, "max_abs_diff": None}
    if fast.decode is not None:
        conv, ssm = caches[0]
        (c1, s1), (c2, s2) = (conv.clone(), ssm.clone()), (conv.clone(), ssm.clone())
        err = (fused(c2, s2) - reference(c1, s1)).abs().max().item()
        row["max_abs_diff"] = max(err, (s2 - s1).abs().max().item())
        state_bytes = 2 * seqs * layers * shape.n_heads * shape.head_dim * shape.d_state * 4  # read + written
        gb_s = state_bytes / times["fast"]["wall_s"] / 1e9
        row |= {"state_bytes": state_bytes, "state_gb_s": gb_s, **probes,
                "fraction_of_read_write": gb_s / probes["read_write_gb_s"], "fraction_of_read": gb_s / probes["read_gb_s"]}  # fmt: skip
    return row | _sides(times)


def _sides(times: dict[str, dict[str, float]]) -> dict:
    out = {f"{side}_{k}": v for side, t in times.items() for k, v in t.items()}
    if "fast" in times:
        out["speedup_cpu"] = times["reference"]["cpu_s"] / times["fast"]["cpu_s"]
    return out


def markdown(rows: list[dict], env: dict, arch: Arch, quick: bool, preset: str = Preset.BENCH.value) -> str:
    cpu = env["cpu"]
    head = (
        f"# Mixer kernels, fast vs reference{' (quick)' if quick else ''}\n\n"
        f"`{arch.value}` / `{preset}` shapes, fp32, {env['torch_threads']} threads, CPU {cpu['model']} "
        f"({', '.join(cpu['simd_flags'])}), torch {env['torch']}. Load average at start: "
        f"{[round(v, 2) for v in env['load_average_1_5_15m']]} (a shared machine inflates every figure). "
        "Min over repeats, sides alternated; ms of process CPU time (wall in brackets).\n\n"
    )
    table = [
        [
            r["kind"], f"{r['batch']} x {r['tokens']:,}",
            f"{format_number(r['reference_cpu_s'] * 1e3)} ({format_number(r['reference_wall_s'] * 1e3)})",
            f"{format_number(r['fast_cpu_s'] * 1e3)} ({format_number(r['fast_wall_s'] * 1e3)})" if "fast_cpu_s" in r else "—",
            f"{r['speedup_cpu']:.2f}×" if "speedup_cpu" in r else "—",
            f"{r['max_abs_diff']:.1e}" if r["max_abs_diff"] is not None else "—",
        ]
        for r in rows
    ]  # fmt: skip
    headers = [
        "kernel", "sequences x tokens (prefill attention: chunk x history)",
        "reference ms", "fast ms", "speedup (CPU)", "max |diff|",
    ]  # fmt: skip
    memory = [r for r in rows if "state_gb_s" in r]
    if memory:
        head_note = (
            "\n\nDecode mixer, SSM state read + written per step at the fast side's wall time, against this "
            f"machine's probes: in-place read + write {memory[0]['read_write_gb_s']:.1f} GB/s, read "
            f"{memory[0]['read_gb_s']:.1f} GB/s (512 MB each, measured at start).\n\n"
        )
        lines = [
            [r["batch"], f"{r['state_bytes'] / 1e6:,.0f}", f"{r['state_gb_s']:.1f}",
             f"{r['fraction_of_read_write']:.0%}", f"{r['fraction_of_read']:.0%}"]
            for r in memory
        ]  # fmt: skip
        memory_headers = ["sequences", "state MB per step", "GB/s", "of read + write", "of read"]
        return head + markdown_table(headers, table, "llrrrr") + head_note + markdown_table(memory_headers, lines, "rrrrr")
    return head + markdown_table(headers, table, "llrrrr")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two rows per kernel, 3 repeats")
    parser.add_argument("--arch", type=Arch, choices=list(Arch), default=Arch.GRANITEMOEHYBRID)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat: proves it runs, measures nothing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plan, repeats = (SMOKE, 1) if args.smoke else (QUICK, 3) if args.quick else (FULL, 7)
    repeats = args.repeats or repeats
    preset = Preset.TINY if args.smoke else Preset.BENCH
    config = read_model_config(checkpoint_dir(args.arch, preset, 0, None))
    built = {"scan_kernel_built": scan_kernels() is not None, "decode_kernels_built": decode_kernels() is not None}
    env = environment_info() | built
    rows = [scan_row(config.mamba, b, t, repeats) for b, t in plan["scan"]]
    rows.append(scan_row(config.mamba, 8, 128 if args.smoke else 512 if args.quick else 2048, repeats, short=32))
    rows += [mixer_row(config.mamba, config.hidden_size, b, t, repeats) for b, t in plan["mixer"]]
    rows += [prefill_attention_row(config.attention, n, t, repeats) for n, t in plan["prefill_attention"]]
    rows += [attention_row(config.attention, b, t, repeats) for b, t in plan["attention"]]
    probes = memory_probes()
    rows += [decode_mixer_row(config, b, repeats, probes) for b in plan["decode_mixer"]]
    name = "kernels.smoke" if args.smoke else "kernels.quick" if args.quick else "kernels"
    data = {
        "environment": env, "arch": args.arch.value, "preset": preset.value, "quick": args.quick, "repeats": repeats,
        "rows": rows,
    }  # fmt: skip
    json_path, md_path = write_results(
        name, data, markdown(rows, env, args.arch, args.quick, preset.value), args.results_dir
    )
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
