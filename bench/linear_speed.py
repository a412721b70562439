"""The blocks' weight matmuls on every backend: what a forward's linears cost at each row count.

    python -m bench.linear_speed [--quick] [--arch granitemoehybrid] [--repeats 5]

One timed call is a pass over every linear of the model's blocks in model order (what a
forward does: each weight read once, from memory, the model being far larger than the L3),
with an [rows, in] input, on one backend (`workers.kernels.linear_tuning`):

    torch        F.linear on the weight as loaded (MKL sgemm): the reference
    onednn       oneDNN on its blocked copy of the weight
    panels       csrc/panel_gemm.cpp on 16-column k-major panels
    panels_int8  the same kernel on int8 weights + per-channel scales (the int8 mode: other
                 numbers, so its error against F.linear is shown beside it)

Figures: ms per pass (min over repeats, backends alternated within each repeat), the fp32
weight bytes over that time (GB/s; for int8 the bytes it stands for, a quarter of which it
reads), GFLOPS, and the largest output difference from F.linear. The panel kernel's time is also
given against its two floors, both from the same run: the memory floor, its own 1-row pass (a
pass over the weights with next to no arithmetic), and the compute floor, the pass's flops at the
measured fp32 peak (`bench.kit.roofline.fp32_peak`, operands hot in the caches). Writes
bench/results/linear_speed[.quick].{json,md,png} (--smoke, the tiny checkpoint in seconds:
linear_speed.smoke.*; --results-dir elsewhere).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from bench.kit.checkpoints import checkpoint_dir
from bench.kit.environment import environment_info
from bench.kit.results import RESULTS_DIR, write_results
from bench.kit.roofline import fp32_peak
from bench.kit.tables import format_number, markdown_table
from workers.checkpoint import Arch, Preset
from workers.kernels.linear_backends import LinearBackend, available_backends, bind, pack_for
from workers.model.loader import load_model

ROWS_FULL = (1, 2, 4, 8, 16, 32, 64, 256, 1024)
ROWS_QUICK = (1, 8, 32)


def _passes(linears: list[nn.Linear], backends: tuple[LinearBackend, ...]):
    """One callable per backend: x_by_in[in_features] -> a pass over every linear."""

    def make(backend: LinearBackend):
        # Bound once, as the engine's linears call them (`linear_backends.bind`).
        bound = [(m.in_features, *bind(backend, m.weight, pack_for(backend, m.weight) if backend.packed else None,
                                       m.bias, m.out_features)) for m in linears]  # fmt: skip
        return lambda xs: [fn(xs[k], *args) for k, fn, args in bound]

    return {b: make(b) for b in backends}


def measure(linears: list[nn.Linear], rows: int, repeats: int, backends: tuple[LinearBackend, ...]) -> dict:
    xs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
    passes = _passes(linears, backends)
    reference = passes[LinearBackend.TORCH](xs)
    best = {b: float("inf") for b in backends}
    error = {}
    for b, run in passes.items():  # warm-up, and the difference from F.linear
        out = run(xs)
        error[b.value] = max(float((o - r).abs().max()) for o, r in zip(out, reference))
    for _ in range(repeats):
        for b, run in passes.items():
            start = time.perf_counter()
            run(xs)
            best[b] = min(best[b], time.perf_counter() - start)
    weight_bytes = sum(m.weight.numel() * 4 for m in linears)
    flops = 2 * rows * sum(m.weight.numel() for m in linears)
    return {
        "rows": rows,
        "ms": {b.value: t * 1e3 for b, t in best.items()},
        "gb_s": {b.value: weight_bytes / t / 1e9 for b, t in best.items()},
        "gflops": {b.value: flops / t / 1e9 for b, t in best.items()},
        "max_abs_diff_vs_torch": error,
    }


def add_floors(rows: list[dict], peak_gflops: float) -> None:
    """Each row's panel time over the memory floor (the same run's 1-row panel pass) and the
    compute floor (its flops at the measured peak); nothing when the 1-row pass was not run."""
    one_row = next((r["ms"].get(LinearBackend.PANELS.value) for r in rows if r["rows"] == 1), None)
    if one_row is None:
        return
    panels = LinearBackend.PANELS.value
    for r in rows:
        compute_ms = r["gflops"][panels] * r["ms"][panels] / peak_gflops  # the pass's flops at the peak
        r["panels_floors"] = {
            "memory_ms": one_row,
            "compute_ms": compute_ms,
            "over_memory": r["ms"][panels] / one_row,
            "over_compute": r["ms"][panels] / compute_ms,
        }


def markdown(
    rows: list[dict], env: dict, arch: Arch, quick: bool, weight_mib: float, preset: str = Preset.BENCH.value
) -> str:
    cpu = env["cpu"]
    backends = list(rows[0]["ms"])
    head = (
        f"# Weight matmuls per backend{' (quick)' if quick else ''}\n\n"
        f"`{arch.value}` / `{preset}` preset: a pass over every block linear ({weight_mib:.0f} MiB of fp32 weights), "
        f"{env['torch_threads']} threads, CPU {cpu['model']} ({', '.join(cpu['simd_flags'])}), torch {env['torch']}. "
        f"Load average at start: {[round(v, 2) for v in env['load_average_1_5_15m']]}. Min over repeats, backends "
        "alternated. GB/s = fp32 weight bytes / time (for panels_int8 the bytes it stands for; it reads a quarter). "
        "`panels_int8` is the int8 mode (other numbers: see its error), not a like-for-like backend.\n\n"
    )
    headers = ["rows"] + [f"{b} ms (GB/s)" for b in backends] + ["best fp32", "panels max |diff|", "int8 max |diff|"]
    floors = "panels_floors" in rows[0]
    if floors:
        headers += ["panels / memory floor", "panels / compute floor"]
    table = []
    for r in rows:
        fp32 = {b: r["ms"][b] for b in backends if b != LinearBackend.PANELS_INT8.value}
        cells = [f"{format_number(r['ms'][b], 2)} ({format_number(r['gb_s'][b])})" for b in backends]
        diff = r["max_abs_diff_vs_torch"]
        line = [r["rows"], *cells, min(fp32, key=fp32.get),
                f"{diff.get('panels', float('nan')):.1e}", f"{diff.get('panels_int8', float('nan')):.1e}"]  # fmt: skip
        if floors:
            f = r["panels_floors"]
            line += [f"{f['over_memory']:.2f} ({format_number(f['memory_ms'], 2)} ms)",
                     f"{f['over_compute']:.2f} ({format_number(f['compute_ms'], 2)} ms)"]  # fmt: skip
        table.append(line)
    tail = ""
    if floors:
        tail = (
            f"\nFloors of the panel kernel, same run: memory = its 1-row pass; compute = the pass's flops at "
            f"{format_number(env['fp32_peak_gflops'])} GFLOPS, the best of `bench.kit.roofline.fp32_peak`'s probes.\n"
        )
    return head + markdown_table(headers, table) + tail


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for b in rows[0]["gb_s"]:
        ax.plot([r["rows"] for r in rows], [r["gb_s"][b] for r in rows], marker="o", label=b)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per matmul (decode: the batch size)")
    ax.set_ylabel("fp32 weight GB/s (higher is faster)")
    ax.set_title("A pass over the blocks' weights, per backend")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"rows {ROWS_QUICK}, 3 repeats")
    parser.add_argument("--arch", type=Arch, choices=list(Arch), default=Arch.GRANITEMOEHYBRID)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint, rows 1 and 8, one repeat: proves it runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = Preset.TINY if args.smoke else Preset.BENCH
    model = load_model(checkpoint_dir(args.arch, preset, 0, None), torch.float32, "cpu")
    linears = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    backends = available_backends()
    if LinearBackend.PANELS in backends:
        backends += (LinearBackend.PANELS_INT8,)
    row_counts, repeats = ((1, 8), 1) if args.smoke else (ROWS_QUICK, 3) if args.quick else (ROWS_FULL, 5)
    repeats = args.repeats or repeats
    env = environment_info()
    with torch.inference_mode():
        rows = [measure(linears, n, repeats, backends) for n in row_counts]
        if LinearBackend.PANELS in backends:
            env["fp32_peak_probes_gflops"] = fp32_peak()
            env["fp32_peak_gflops"] = max(env["fp32_peak_probes_gflops"].values())
            add_floors(rows, env["fp32_peak_gflops"])
    weight_mib = sum(m.weight.numel() * 4 for m in linears) / 2**20
    name = "linear_speed.smoke" if args.smoke else "linear_speed.quick" if args.quick else "linear_speed"
    data = {
        "environment": env, "arch": args.arch.value, "preset": preset.value, "quick": args.quick, "repeats": repeats,
        "weight_mib": weight_mib, "rows": rows,
    }  # fmt: skip
    markdown_text = markdown(rows, env, args.arch, args.quick, weight_mib, preset.value)
    json_path, md_path = write_results(name, data, markdown_text, args.results_dir)
    plot(rows, args.results_dir / f"{name}.png")
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {args.results_dir / f'{name}.png'}")


if __name__ == "__main__":
    main()
