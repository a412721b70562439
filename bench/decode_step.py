"""One engine decode step, fast path vs the pure-torch reference: `python -m bench.decode_step`.

    python -m bench.decode_step [--arch granitemoehybrid nemotron_h] [--concurrency 1 8] [--repeats 5]

For each concurrency, `concurrency` prompts of 128 tokens are prefilled, then `LLMEngine.step()`
(schedule, build the batch, forward, sample, stop checks: the whole step) is timed on pure decode
steps. The two paths alternate inside one process on the same running requests, `steps` steps
each per repeat; the weight matmuls run on plain `F.linear` on both sides (`--tuned-linears`
keeps the measured backends on the fast side), so the difference is the decode step's own
work: the Mamba mixer, attention, norms, activations, residual adds and the step's Python.
The figure is the minimum over steps of process CPU time (what the threads spent; a shared
machine inflates it less than wall time), wall time beside it.
Writes bench/results/decode_step.{json,md} (--smoke, the tiny checkpoints in seconds:
decode_step.smoke.*; --results-dir elsewhere).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.engine.sides import make_prompts
from bench.kit.checkpoints import checkpoint_dir
from bench.kit.environment import environment_info
from bench.kit.results import RESULTS_DIR, write_results
from bench.kit.tables import format_number, markdown_table
from workers.checkpoint import Arch, Preset
from workers.config import CacheConfig, EngineConfig
from workers.engine import LLMEngine
from workers.kernels.linear_plan import LinearPlan
from workers.sampling import SamplingParams

PROMPT_TOKENS = 128


def _time_steps(engine: LLMEngine, steps: int) -> tuple[float, float]:
    """Min CPU and wall seconds of `steps` engine steps."""
    cpu, wall = float("inf"), float("inf")
    for _ in range(steps):
        c, w = time.process_time(), time.perf_counter()
        engine.step()
        cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
    return cpu, wall


def measure(
    arch: Arch, concurrency: int, threads: int, repeats: int, steps: int, tuned: bool, preset: Preset = Preset.BENCH
) -> dict:
    model_dir = checkpoint_dir(arch, preset, 0, None)
    config = EngineConfig(model=str(model_dir), num_threads=threads, cache=CacheConfig(kv_cache_bytes=256 << 20))
    engine = LLMEngine(config)
    runner = engine.runner
    measured: LinearPlan | None = runner.linear_plan  # measured once, at start-up
    new_tokens = 2 * repeats * (steps + 1) + 8  # never finishes while timed: every step is a full decode batch
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(concurrency, PROMPT_TOKENS, seed=0)):
        engine.add_request(f"r{i}", prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    best = {"fast": [float("inf")] * 2, "reference": [float("inf")] * 2}
    with torch.inference_mode():
        for _ in range(repeats):
            for side in best:
                runner.set_fast_kernels(side == "fast", measured)
                if not tuned:
                    runner.model.use_linear_plan(None)
                engine.step()  # the first step after a switch is not timed
                cpu, wall = _time_steps(engine, steps)
                assert len(scheduler.running) == concurrency, "a request finished while timed"
                best[side] = [min(best[side][0], cpu), min(best[side][1], wall)]
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    engine.check_integrity()
    return {
        "arch": arch.value, "concurrency": concurrency,
        "fast_cpu_ms": best["fast"][0] * 1e3, "fast_wall_ms": best["fast"][1] * 1e3,
        "reference_cpu_ms": best["reference"][0] * 1e3, "reference_wall_ms": best["reference"][1] * 1e3,
        "speedup_cpu": best["reference"][0] / best["fast"][0],
    }  # fmt: skip


def markdown(rows: list[dict], env: dict, tuned: bool, preset: str = Preset.BENCH.value) -> str:
    cpu = env["cpu"]
    head = (
        "# One decode step, fast path vs reference\n\n"
        f"`{preset}` checkpoints, fp32, {PROMPT_TOKENS}-token prompts, {env['torch_threads']} threads, CPU {cpu['model']} "
        f"({', '.join(cpu['simd_flags'])}), torch {env['torch']}. Weight matmuls: "
        f"{'measured backends on the fast side' if tuned else 'F.linear on both sides'}. Load average at start: "
        f"{[round(v, 2) for v in env['load_average_1_5_15m']]}. Min over steps, paths alternated; "
        "ms of process CPU time per `LLMEngine.step()` (wall in brackets).\n\n"
    )
    table = [
        [
            r["arch"], r["concurrency"],
            f"{format_number(r['reference_cpu_ms'], 2)} ({format_number(r['reference_wall_ms'], 2)})",
            f"{format_number(r['fast_cpu_ms'], 2)} ({format_number(r['fast_wall_ms'], 2)})",
            f"{r['speedup_cpu']:.2f}×",
        ]
        for r in rows
    ]  # fmt: skip
    return head + markdown_table(["family", "sequences", "reference ms", "fast ms", "speedup (CPU)"], table, "lrrrr")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=Arch, nargs="+", default=[Arch.GRANITEMOEHYBRID, Arch.NEMOTRON_H])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per path per repeat")
    parser.add_argument("--tuned-linears", action="store_true", help="measured matmul backends on the fast side")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny checkpoint, one repeat of 2 steps: proves it runs, measures nothing"
    )
    args = parser.parse_args()
    preset = Preset.TINY if args.smoke else Preset.BENCH
    if args.smoke:
        args.repeats, args.steps = 1, 2
    env = environment_info()
    rows = [
        measure(arch, c, args.threads, args.repeats, args.steps, args.tuned_linears, preset)
        for arch in args.arch
        for c in args.concurrency
    ]
    data = {
        "environment": env, "repeats": args.repeats, "steps": args.steps,
        "tuned_linears": args.tuned_linears, "preset": preset.value, "rows": rows,
    }  # fmt: skip
    name = "decode_step.smoke" if args.smoke else "decode_step"
    json_path, md_path = write_results(name, data, markdown(rows, env, args.tuned_linears, preset.value), args.results_dir)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
