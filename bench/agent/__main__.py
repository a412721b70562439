"""`python -m bench.agent`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import agent as benchmark
from bench.agent.report import markdown, plot
from bench.agent.run import FULL, QUICK, SMOKE, run
from bench.kit.results import RESULTS_DIR, write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=benchmark.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 loops x 4 steps, 2 decode rounds")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint, 2 loops x 3 steps: proves it runs")
    parser.add_argument("--skip-vllm", action="store_true", help="only our app")
    parser.add_argument("--decode-only", action="store_true", help="only the cost of constrained decoding "
                                                                     "(writes <stem>.decode.*)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    res = run(plan, args.quick or args.smoke, args.skip_vllm, args.decode_only)
    stem = ("agent.smoke" if args.smoke else "agent.quick" if args.quick else "agent") + (
        ".decode" if args.decode_only else "")
    md = markdown(res)
    write_results(stem, res, md, args.results_dir)
    plot(res, args.results_dir / f"{stem}.png")
    print(md)
    print(json.dumps(res["headline"], indent=2))


if __name__ == "__main__":
    main()
