"""`python -m bench.determinism`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench import determinism as described
from bench.determinism.report import markdown, plot, summarize
from bench.determinism.run import FULL, QUICK, SMOKE, Bench, benchmark, make_jobs
from bench.kit.checkpoints import checkpoint_dir
from bench.kit.environment import cpu_model, environment_info
from bench.kit.results import RESULTS_DIR, write_results
from workers.checkpoint import Arch, Preset, preset_shape


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=described.__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small load, short baselines (a few minutes)")
    parser.add_argument("--arch", type=Arch, choices=list(Arch), default=Arch.BAMBA)
    parser.add_argument("--preset", type=Preset, choices=list(Preset), default=Preset.BENCH)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=None, help="W of the fraction runs")
    parser.add_argument("--rows", type=int, default=None, help="G of the fraction runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="the tiny checkpoint, seconds: proves it runs, measures nothing")
    args = parser.parse_args(argv)

    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.smoke:
        args.preset = Preset.TINY
    plan = replace(plan, window=args.window or plan.window, rows=args.rows or plan.rows)
    torch.set_num_threads(args.threads)
    env = environment_info() | {"cpu_model": cpu_model()}
    model_dir = checkpoint_dir(args.arch, args.preset, args.seed, args.model_dir)
    started = time.perf_counter()
    runs = benchmark(plan, Bench(model_dir, args.threads, plan), make_jobs(plan, args.seed))
    shape = preset_shape(args.arch, args.preset)
    results = {
        "benchmark": "determinism",
        "environment": env,
        "load_average_at_end": list(os.getloadavg()),
        "wall_seconds": time.perf_counter() - started,
        "model": {"arch": args.arch.value, "preset": args.preset.value, "seed": args.seed,
                  "hidden_size": shape.hidden_size, "layer_pattern": shape.layer_pattern, "dtype": "float32"},
        "settings": asdict(plan) | {"threads": args.threads, "quick": args.quick, "smoke": args.smoke},
        "summary": summarize(runs, plan),
        "runs": [r.as_dict() for r in runs],
    }  # fmt: skip
    name = "determinism.smoke" if args.smoke else "determinism.quick" if args.quick else "determinism"
    json_path, md_path = write_results(name, results, markdown(results), args.results_dir)
    plot(results, args.results_dir / f"{name}.png")
    print(markdown(results))
    print(f"wrote {json_path}, {md_path}, {args.results_dir / f'{name}.png'}")
    return results


if __name__ == "__main__":
    main()
