"""What constrained decoding costs per decoded token: `python -m bench.grammar_cost [--quick|--smoke]`.

One engine (the worker's configuration: one torch thread), C requests decoding at once, the same
prompts and seeds with the grammar on and off, rounds alternating. Replies have equal lengths on
both sides: `ignore_eos`, and a grammar that cannot be complete before max_tokens (a JSON array
of at least 10,000 digits), so every step of both sides decodes the whole batch and the median
full-batch step time compares like with like. (Measured over HTTP, unconstrained replies of the
random model end early and their batches shrink: bench.agent's decode pair says so.)

The grammar's work per token: the matcher consumes the token on the engine thread, the next
mask is computed on a grammar thread while the model runs, the sampler masks the row.
Target (issue: agent loops): at most +10% per token at concurrency 8.
Writes bench/results/grammar_cost[.quick|.smoke].{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.kit.environment import environment_info
from bench.kit.results import RESULTS_DIR, write_results
from bench.kit.tables import markdown_table

NEVER_COMPLETE = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 10_000}


def _round(engine, constrained: bool, tag: str, concurrency: int, max_tokens: int) -> list[float]:
    from workers.sampling import SamplingParams

    constraint = {"type": "json_schema", "schema": NEVER_COMPLETE} if constrained else None
    for i in range(concurrency):
        engine.add_request(f"{tag}-{i}", list(range(6, 70)), SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True, constraint=constraint))
    full_steps = []
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        if sum(len(o.new_tokens) for o in outputs) == concurrency:  # a decode step of the whole batch
            full_steps.append(elapsed)
    return full_steps


def measure(arch: str, preset: str, concurrency: int, max_tokens: int, rounds: int) -> dict:
    from workers.checkpoint import make_model
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig
    from workers.engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", arch, preset)
        engine = LLMEngine(EngineConfig(model=str(model), num_threads=1, cache=CacheConfig(kv_cache_bytes=256 << 20),
                                        scheduler=SchedulerConfig(max_num_seqs=concurrency)))
        _round(engine, True, "warm-on", concurrency, 8)
        _round(engine, False, "warm-off", concurrency, 8)
        steps: dict[str, list[float]] = {"off": [], "on": []}
        per_round = []
        for r in range(rounds):
            off = _round(engine, False, f"off-{r}", concurrency, max_tokens)
            on = _round(engine, True, f"on-{r}", concurrency, max_tokens)
            steps["off"] += off
            steps["on"] += on
            per_round.append({"off_ms": statistics.median(off) * 1e3, "on_ms": statistics.median(on) * 1e3})
        engine.check_integrity()
    off_ms, on_ms = (statistics.median(steps[k]) * 1e3 for k in ("off", "on"))
    return {"arch": arch, "preset": preset, "concurrency": concurrency, "max_tokens": max_tokens, "rounds": per_round,
            "step_ms_off": off_ms, "step_ms_on": on_ms, "extra_per_token": on_ms / off_ms - 1,
            "steps_measured": {k: len(v) for k, v in steps.items()}}


def markdown(data: dict) -> str:
    env, r = data["environment"], data["result"]
    rows = [[i + 1, f"{x['off_ms']:.2f}", f"{x['on_ms']:.2f}", f"{(x['on_ms'] / x['off_ms'] - 1) * 100:+.1f}%"]
            for i, x in enumerate(r["rounds"])]
    rows.append(["all (median)", f"{r['step_ms_off']:.2f}", f"{r['step_ms_on']:.2f}", f"{r['extra_per_token'] * 100:+.1f}%"])
    return "\n".join([
        f"# Constrained decoding: cost per decoded token{' (' + data['mode'] + ')' if data['mode'] != 'full' else ''}",
        "",
        f"{r['arch']} `{r['preset']}` checkpoint (random weights), one engine with one torch thread, "
        f"{r['concurrency']} requests decoding at once, {r['max_tokens']} tokens each, the same prompts and seeds "
        "with a JSON-schema grammar on and off (equal reply lengths: ignore_eos, and a grammar that cannot be "
        "complete within max_tokens). Median time of a decode step of the whole batch, per round and overall. "
        f"CPU: {env['cpu']['model']} ({', '.join(env['cpu']['simd_flags'])}); load average at start "
        f"{env.get('load_average_1_5_15m')}.",
        "",
        markdown_table(["round", "grammar off, ms/step", "grammar on, ms/step", "extra per token"], rows),
        "",
        f"Target: at most +10% per token at concurrency 8: {'met' if r['extra_per_token'] <= 0.10 else 'NOT met'} "
        f"({r['extra_per_token'] * 100:+.1f}%).",
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--smoke", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    name, plan = "full", ("granitemoehybrid", "bench", 8, 256, 5)
    if args.quick:
        name, plan = "quick", ("granitemoehybrid", "bench", 8, 160, 3)
    elif args.smoke:
        name, plan = "smoke", ("granitemoehybrid", "tiny", 2, 16, 1)
    data = {"mode": name, "environment": environment_info(), "result": measure(*plan)}
    stem = "grammar_cost" if name == "full" else f"grammar_cost.{name}"
    for path in write_results(stem, data, markdown(data), args.results_dir):
        print(path)


if __name__ == "__main__":
    main()
