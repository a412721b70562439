"""`python -m bench.scale`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench import scale as benchmark
from bench.kit.environment import cpu_model
from bench.kit.results import RESULTS_DIR, git_revision, write_results
from bench.scale import cost_model, mix
from bench.scale.drive import Plan, Point, run_point
from bench.scale.report import markdown, plot
from bench.scale.sizing import SATURATED, bottleneck, offered_turns_per_s, size

FULL = Plan(points=(Point(10, 10_000, 1), Point(100, 10_000, 1), Point(1000, 10_000, 1),
                    Point(100, 10_000, 2), Point(1000, 10_000, 2), Point(100, 100_000, 1)),
            warmup_s=6.0, measure_s=20.0, max_sessions=2048, state_bytes=256 << 10)
QUICK = Plan(points=(Point(10, 5_000, 1), Point(100, 5_000, 1), Point(100, 5_000, 2)),
             warmup_s=3.0, measure_s=8.0, max_sessions=1024, state_bytes=256 << 10)
NOT_RUN_CONVERSATIONS = 1_000_000
LOCKED_RUN_BUDGET_S = 600  # a run under the shared lock stays under 10 minutes


def stopped_text(points: list[dict], wall_s: float) -> str:
    seed_rate = min(p["seed"]["per_s"] for p in points)
    per_conv = max(p["seed"]["redis_bytes_per_conversation"] for p in points)
    largest = max(p["point"]["conversations"] for p in points)
    seed_min = NOT_RUN_CONVERSATIONS / seed_rate / 60
    idle = [p["point"]["replicas"] for p in points if p["turns"] == 0]
    text = (f"Replicas ran up to {max(p['point']['replicas'] for p in points):,}; stored conversations up to "
            f"{largest:,}. {NOT_RUN_CONVERSATIONS:,} conversations were not run, for time: seeding them "
            f"(two Lua scripts each, pipelined, {seed_rate:,.0f} conversations/s here) would take "
            f"{seed_min:.0f} minutes on top of this sweep's {wall_s / 60:.0f}, over the {LOCKED_RUN_BUDGET_S // 60}-minute "
            f"budget of a run on this shared machine. Memory would hold: {per_conv:,.0f} bytes of Redis per stored "
            f"one-turn conversation, {per_conv * NOT_RUN_CONVERSATIONS / 1e9:.1f} GB for a million (the ledger grows "
            "with each turn).")
    if idle:
        text += (f" At {', '.join(f'{r:,}' for r in sorted(set(idle)))} replicas no turn completed inside the window: "
                 "the driver's process (the router and the clients of every session) "
                 "used its whole core, acquires waited tens of seconds and leases lapsed (LeaseLost); those points "
                 "give the router's cost per decision and nothing per turn.")
    return text


def saturation_text(sizing: dict, points: list[dict]) -> str:
    first = sizing["first_saturated_point"]
    if first is None:
        return f"No point fell below {SATURATED:.0%} of its offered turn rate."
    cores = ", ".join(f"{k} {v:.2f}" for k, v in sizing["first_saturated_cpu_cores"].items())
    widest = max(points, key=lambda p: p["point"]["replicas"])
    return (f"First below {SATURATED:.0%} of its offered rate: {first['replicas']:,} replicas, {first['conversations']:,} "
            f"conversations, {first['instances']} instance(s); the busiest process there is "
            f"**{sizing['first_saturated_by']}** (CPU cores used: {cores}; the machine has {os.cpu_count()}). "
            f"At {widest['point']['replicas']:,} replicas the router's own choose_replicas costs "
            f"{widest['route']['mean_ms']:.1f} ms per turn (beyond 64 candidates it prices a shortlist), "
            f"in the driver's process. The driver (router + the gRPC clients of every session, one Python process) "
            f"and the one instance each use most of a core: on this 2-core machine they run out together, so the "
            f"capacities below are per core-second of each process (each is bound by one core in production).")


def results(plan: Plan, mode: str, points: list[dict], load_before, started: float) -> dict:
    sizing = size(points)
    return {
        "mode": mode,
        "plan": asdict(plan), "batch": cost_model.BATCH,
        "cost_model": {"source": cost_model.SOURCE, "fit": (
            f"a replica runs {cost_model.BATCH} turns at once, each taking new prompt tokens / "
            f"{cost_model.PREFILL_TOKENS_PER_S:,.1f} tok/s + output tokens / {cost_model.DECODE_TOKENS_PER_S:.2f} tok/s "
            f"(+ head tokens / {cost_model.IMPORT_TOKENS_PER_S:,.0f} tok/s when the head moved), the measured c=32 "
            "aggregate speeds split over the slots."),
            "gpu_turns_per_s": cost_model.GPU_TURNS_PER_S},
        "mix": (f"sessions are {mix.CHAT_SHARE:.0%} chat turns (prompt 30-400, reply 80-500 tokens, "
                f"{mix.LONG_ANSWER_SHARE:.0%} long answers of {mix.LONG_ANSWER_TOKENS} tokens; head exported after "
                "each) and the rest agent loops (3-12 back-to-back steps, tool results 150-2,000 tokens in, "
                "20-150 out; head exported after the last), over conversations drawn uniformly from the stored ones."),
        "points": points, "sizing": sizing,
        "stopped": stopped_text(points, time.perf_counter() - started), "saturation": saturation_text(sizing, points),
        "env": {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "load_before": list(load_before),
                "load_after": list(os.getloadavg()), "git": git_revision(),
                "wall_s": time.perf_counter() - started},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=benchmark.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three small points, < 2 minutes")
    parser.add_argument("--max-points", type=int, default=0, help="run only the first N points of the plan")
    parser.add_argument("--smoke", action="store_true", help="the quick plan's first point: proves it runs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    plan = QUICK if args.quick or args.smoke else FULL
    if args.smoke:
        args.max_points = 1
    if args.max_points:
        plan = replace(plan, points=plan.points[:args.max_points])
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    stem = "scale.smoke" if args.smoke else "scale.quick" if args.quick else "scale"
    # An earlier run kept beside this one (e.g. scale.before.json: the curve before a change) is
    # compared point by point in the Markdown and drawn in the plot.
    before_path = args.results_dir / f"{stem}.before.json"
    before = json.loads(before_path.read_text()) if before_path.exists() else None
    load_before, started = os.getloadavg(), time.perf_counter()
    points = []
    for point in plan.points:
        result = asyncio.run(run_point(point, plan))
        result["offered_turns_per_s"] = offered_turns_per_s(point.replicas, result["sessions"])
        print(f"{point}: {result['turns_per_s']:.0f} turns/s (offered {result['offered_turns_per_s']:.0f}), "
              f"route {result['route']['mean_ms']:.2f} ms, cpu {result['cpu_cores']}, busiest {bottleneck(result)}",
              flush=True)
        points.append(result)
        # After every point: a run stopped by its time limit keeps what it measured.
        res = results(plan, mode, points, load_before, started)
        write_results(stem, res, markdown(res, before), args.results_dir)
        plot(res, args.results_dir / f"{stem}.png", before)
    print(markdown(res))


if __name__ == "__main__":
    main()
