"""`python -m bench.grammar_backends`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench import grammar_backends as benchmark
from bench.grammar_backends.measure import run
from bench.grammar_backends.plan import MODES
from bench.grammar_backends.report import markdown
from bench.kit.environment import environment_info
from bench.kit.results import RESULTS_DIR, write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=benchmark.__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="the 104 and 32k tokenizers, fewer replays")
    group.add_argument("--smoke", action="store_true", help="the 104-id tokenizer, two grammars: proves it runs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    torch.set_num_threads(1)
    env = environment_info()
    data = {"environment": env, **run(mode)}
    json_path, md_path = write_results(mode.name, data, markdown(data), args.results_dir)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
