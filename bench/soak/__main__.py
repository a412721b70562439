"""`python -m bench.soak`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from bench import soak as benchmark
from bench.kit.results import RESULTS_DIR, git_revision, write_results
from bench.soak.report import analyze, markdown, plot
from bench.soak.run import FULL, SMOKE, run


def main() -> None:
    parser = argparse.ArgumentParser(description=benchmark.__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few dozen calls on the tiny checkpoint, TTL 3 s: "
                                                             "proves it runs")
    parser.add_argument("--tiny", action="store_true", help="the full run on the tiny test checkpoint instead of the "
                                                            "built-in model (the calls cost less compute)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where to write (default bench/results)")
    opts = parser.parse_args()
    plan = SMOKE if opts.smoke else replace(FULL, builtin_model=False) if opts.tiny else FULL
    result = run(plan)
    result["report"] = analyze(result)
    result["git"] = git_revision()
    name = "soak.smoke" if opts.smoke else "soak"
    json_path, md_path = write_results(name, result, markdown(result), opts.results_dir)
    plot(result, opts.results_dir / f"{name}.png")
    print(markdown(result))
    print(f"wrote {json_path}, {md_path} and {name}.png")
    sys.exit(0 if all(result["report"]["checks"].values()) else 1)


if __name__ == "__main__":
    main()
