"""`python -m bench.serve`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import serve as benchmark
from bench.kit.results import RESULTS_DIR, write_results
from bench.serve import vllm_backend
from bench.serve.measure import run
from bench.serve.plan import FULL, QUICK, SMOKE, Plan
from bench.serve.report import markdown, plot


def main() -> None:
    parser = argparse.ArgumentParser(description=benchmark.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 conversations x 4 short turns; 8 x 4 multi-turn "
                                                             "clients; 16 shared-prompt conversations")
    parser.add_argument("--skip-vllm", action="store_true", help="only our app")
    parser.add_argument("--skip-app", action="store_true", help="only vLLM")
    parser.add_argument("--vllm-results", type=Path, help="take (c), (d) from an earlier run's JSON (same plan)")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint, one short conversation: proves it runs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--model", type=Path, help="serve this checkpoint instead of the random GraniteMoeHybrid "
                                                   "preset (e.g. workers/checkpoint/builtin_trained); vLLM too")
    parser.add_argument("--backend", choices=("ours", "vllm"), default="ours",
                        help="vllm: the multi-turn workload on our app's vLLM backend, vLLM's server and our "
                             "engine (bench/serve/vllm_backend.py)")
    parser.add_argument("--sides", default="vadc", help="--backend vllm: which sides run, of v (our app on vLLM), a "
                                                         "(our engine), d and c (vLLM's server, prefix caching off/on)")
    args = parser.parse_args()
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.backend == "vllm":
        if args.skip_app or args.vllm_results or args.model:
            parser.error("--backend vllm runs every side itself on its own models: no --skip-app, --vllm-results "
                         "or --model")
        if not args.sides or set(args.sides) - set("vadc"):
            parser.error(f"--sides takes letters of vadc, not {args.sides!r}")
        main_vllm_backend(plan, args)
        return
    res = run(plan, args.quick or args.smoke, args.skip_vllm, args.skip_app, args.vllm_results, args.model)
    stem = "serve.smoke" if args.smoke else "serve.quick" if args.quick else "serve"
    md = markdown(res)
    write_results(stem, res, md, args.results_dir)
    if res["modes"] or any(res["prefix"].values()):
        plot(res, args.results_dir / f"{stem}.png")
    print(md)
    print(json.dumps(res["headline"] | {"prefix": res["prefix_headline"]}, indent=2))


def main_vllm_backend(plan: Plan, args: argparse.Namespace) -> None:

    models = (vllm_backend.DENSE,) if args.smoke else (vllm_backend.DENSE, vllm_backend.MOE)
    variant = "smoke" if args.smoke else "quick" if args.quick else "full"
    res = vllm_backend.run(plan, models, variant, args.skip_vllm, args.sides)
    stem = "serve.vllm.smoke" if args.smoke else "serve.vllm.quick" if args.quick else "serve.vllm"
    md = vllm_backend.markdown(res)
    write_results(stem, res, md, args.results_dir)
    vllm_backend.plot(res, args.results_dir / f"{stem}.png")
    print(md)
    print(json.dumps({name: rec["headline"] for name, rec in res["models"].items()}, indent=2))


if __name__ == "__main__":
    main()
