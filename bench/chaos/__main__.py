"""`python -m bench.chaos`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import chaos as benchmark
from bench.chaos.plan import ChaosPlan
from bench.chaos.run import FULL, QUICK, SMOKE, markdown, run
from bench.kit.results import write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=benchmark.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI-sized run (8 x 5 turns)")
    parser.add_argument("--smoke", action="store_true", help="3 x 2 turns, one fault: proves it runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-dir", type=Path, default=None, help="where to write (default bench/results)")
    opts = parser.parse_args()
    base = SMOKE if opts.smoke else QUICK if opts.quick else FULL
    plan = ChaosPlan(**{**base.__dict__, "seed": opts.seed})
    result = run(plan)
    name = "chaos.smoke" if opts.smoke else "chaos.quick" if opts.quick else "chaos"
    kwargs = {"results_dir": opts.results_dir} if opts.results_dir else {}
    json_path, md_path = write_results(name, result, markdown(result), **kwargs)
    print(markdown(result))
    print(f"wrote {json_path} and {md_path}")
    sys.exit(1 if result["report"]["divergences"] else 0)


if __name__ == "__main__":
    main()
