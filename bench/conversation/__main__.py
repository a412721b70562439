"""`python -m bench.conversation`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import conversation as benchmark
from bench.conversation.plan import FULL, QUICK, SMOKE
from bench.conversation.report import markdown, plot
from bench.conversation.run import run
from bench.kit.results import RESULTS_DIR, write_results
from workers.checkpoint import Arch




def main() -> None:
    parser = argparse.ArgumentParser(description=benchmark.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (fewer turns, shorter lengths)")
    parser.add_argument("--arch", type=Arch, choices=list(Arch), default=Arch.GRANITEMOEHYBRID)
    parser.add_argument("--no-vllm", action="store_true", help="leave the vLLM-CPU mode (v) out")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 short turns: proves it runs, measures nothing")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    # The smoke's tiny checkpoint has 16-wide attention heads, which vLLM-CPU's attention refuses
    # ("Unsupported CPU attention configuration: head_dim=16"): the smoke leaves vLLM out.
    res = run(plan, args.quick or args.smoke, args.arch, not (args.no_vllm or args.smoke))
    stem = "conversation.smoke" if args.smoke else "conversation.quick" if args.quick else "conversation"
    write_results(stem, res, markdown(res), args.results_dir)
    plot(res, args.results_dir / f"{stem}.png")
    print(markdown(res))
    if not res["correctness"]["a_equals_c_every_turn"]:
        print("FAIL: (a) and (c) disagree:", res["correctness"]["mismatches"], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
