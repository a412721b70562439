"""Deterministic-mode benchmark: `python -m bench.determinism [--quick]`.

On the `bench` checkpoint under a steady mixed load (a closed loop keeps `concurrency`
requests in flight until `requests` have finished; prompt and reply lengths vary), a
fraction of the requests is deterministic (decode on the fast path, verify in G x W tiles,
roll back). Measured:

    throughput (output tokens/s) relative to the all-ordinary run, at 0, 2, 10, 50, 100 %
    baselines, where every request is deterministic by other means:
      (a) fixed-shape path for everything: every token of every request from a tile pass
          (DeterministicConfig(fast_decode=False)); no dynamic batching of any kernel
      (b) no dynamic batching: one request at a time (max_num_seqs = 1)
    rollback % (candidates thrown away / deterministic tokens) and throughput at W = 16..128
    rows per pass G = 4, 8, 16 at the chosen W
    p50 / p99 latency of deterministic requests (submit -> last token), and of ordinary ones

The baselines are slow, so they run for a fixed time budget and count the tokens produced
in it (tokens/s over the window; each still starts with its prefills).

Writes bench/results/determinism.{json,md,png} (a quick run: determinism.quick.*; --smoke, the
tiny checkpoint in seconds: determinism.smoke.*; --results-dir elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import RESULTS_DIR, environment_info, markdown_table, write_results
from bench.engine import checkpoint_dir
from workers.checkpoint import Arch, Preset, preset_shape
from workers.checkpoint.tokens import ORDINARY_TOKEN_IDS
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.deterministic.config import DeterministicConfig
from workers.deterministic.metrics import DeterministicMetrics
from workers.engine import LLMEngine
from workers.sampling import SamplingParams

FRACTIONS = (0.0, 0.02, 0.10, 0.50, 1.0)
TARGETS = {0.10: 0.9, 0.50: 0.75}


@dataclass(frozen=True)
class Plan:
    concurrency: int
    requests: int
    prompt_len: tuple[int, int]
    new_tokens: tuple[int, int]
    window: int
    rows: int
    windows: tuple[int, ...]  # W sweep
    rows_sweep: tuple[int, ...]
    baseline_seconds: float


FULL = Plan(8, 12, (32, 96), (40, 80), 64, 1, (16, 32, 64, 128), (1, 4), 45.0)
QUICK = Plan(4, 6, (16, 48), (16, 24), 32, 1, (16, 64), (1, 4), 10.0)
SMOKE = Plan(2, 3, (8, 20), (4, 8), 16, 1, (16,), (1,), 0.5)  # with --preset tiny: proves it runs, measures nothing


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    seed: int


def make_jobs(plan: Plan, seed: int) -> list[Job]:
    rng = random.Random(seed)
    ids = sorted(ORDINARY_TOKEN_IDS)
    return [
        Job([rng.choice(ids) for _ in range(rng.randint(*plan.prompt_len))], rng.randint(*plan.new_tokens), i)
        for i in range(plan.requests)
    ]


def deterministic_indices(n: int, fraction: float) -> set[int]:
    """round(fraction * n) requests, spread evenly over the arrival order."""
    k = round(fraction * n)
    return {int(i * n / k) for i in range(k)} if k else set()


@dataclass
class RunResult:
    label: str
    fraction: float
    window: int
    rows: int
    seconds: float
    cpu_seconds: float
    output_tokens: int
    deterministic_tokens: int
    finished: int
    latencies_det: list[float]
    latencies_ord: list[float]
    metrics: dict
    truncated: bool  # stopped by the time budget

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        """Output tokens per process CPU second: on a shared machine, the cost of the work
        itself (wall time also counts the time other processes held the cores)."""
        return self.output_tokens / self.cpu_seconds

    def as_dict(self) -> dict:
        return asdict(self) | {"tokens_per_s": self.tokens_per_s, "tokens_per_cpu_s": self.tokens_per_cpu_s}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class Bench:
    def __init__(self, model_dir: Path, threads: int, plan: Plan):
        self.model_dir, self.threads, self.plan = model_dir, threads, plan
        self._engines: dict[tuple, LLMEngine] = {}

    def engine(self, window: int, rows: int, *, fast_decode: bool = True, max_num_seqs: int | None = None) -> LLMEngine:
        key = (window, rows, fast_decode, max_num_seqs)
        if key not in self._engines:
            self._engines.clear()  # one engine alive at a time: memory stays modest
            gc.collect()
            config = EngineConfig(
                model=str(self.model_dir),
                num_threads=self.threads,
                scheduler=SchedulerConfig(max_num_seqs=max_num_seqs or self.plan.concurrency, max_num_batched_tokens=512),
                cache=CacheConfig(block_size=16, kv_cache_bytes=256 << 20, head_cache_bytes=16 << 20),
                deterministic=DeterministicConfig(
                    window=window, rows=rows, ssd_chunk=16, num_threads=self.threads, fast_decode=fast_decode
                ),
            )
            self._engines[key] = LLMEngine(config)
        engine = self._engines[key]
        engine.verifier.metrics = DeterministicMetrics()
        return engine

    def run(self, label: str, engine: LLMEngine, jobs: list[Job], fraction: float, budget: float | None = None) -> RunResult:
        det = deterministic_indices(len(jobs), fraction)
        queue = list(enumerate(jobs))
        in_flight: dict[str, tuple[float, bool]] = {}
        lat_det, lat_ord = [], []
        tokens = det_tokens = finished = 0
        concurrency = engine.config.scheduler.max_num_seqs
        t0, c0 = time.perf_counter(), time.process_time()
        truncated = False
        while queue or in_flight:
            while queue and len(in_flight) < concurrency:
                i, job = queue.pop(0)
                params = SamplingParams(
                    max_tokens=job.max_tokens, temperature=0.7, seed=job.seed, ignore_eos=True, deterministic=i in det
                )
                rid = f"{label}-{i}"
                engine.add_request(rid, job.prompt, params)
                in_flight[rid] = (time.perf_counter(), i in det)
            for out in engine.step():
                if out.error:
                    raise RuntimeError(out.error)
                n = len(out.new_tokens)
                tokens += n
                det_tokens += n if in_flight[out.request_id][1] else 0
                if out.finished:
                    start, is_det = in_flight.pop(out.request_id)
                    (lat_det if is_det else lat_ord).append(time.perf_counter() - start)
                    finished += 1
            if budget is not None and time.perf_counter() - t0 > budget:
                truncated = True
                for rid in list(in_flight):
                    engine.abort(rid)
                in_flight.clear()
                break
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        cfg = engine.config.deterministic
        engine.check_integrity()
        return RunResult(
            label, fraction, cfg.window, cfg.rows, seconds, cpu, tokens, det_tokens, finished,
            lat_det, lat_ord, engine.verifier.metrics.as_dict(), truncated,
        )  # fmt: skip


def benchmark(plan: Plan, bench: Bench, jobs: list[Job]) -> list[RunResult]:
    w, g = plan.window, plan.rows
    tasks = [("warmup", lambda: bench.run("warmup", bench.engine(w, g), jobs[:2], 0.5))]
    tasks.append(("ordinary-first", lambda: bench.run("fraction", bench.engine(w, g), jobs, 0.0)))
    for f in FRACTIONS[1:]:
        tasks.append((f"fraction {f:.0%}", lambda f=f: bench.run("fraction", bench.engine(w, g), jobs, f)))
    for window in plan.windows:
        tasks.append((f"W={window}", lambda window=window: bench.run("window", bench.engine(window, g), jobs, 0.5)))
    for rows in plan.rows_sweep:
        tasks.append((f"G={rows}", lambda rows=rows: bench.run("rows", bench.engine(w, rows), jobs, 0.5)))
    tasks.append(("baseline (a)", lambda: bench.run(
        "fixed-shape-everything", bench.engine(w, g, fast_decode=False), jobs, 1.0, plan.baseline_seconds)))
    tasks.append(("baseline (b)", lambda: bench.run(
        "one-at-a-time", bench.engine(w, g, max_num_seqs=1), jobs, 0.0, plan.baseline_seconds)))
    results = []
    with tqdm(total=len(tasks), desc="determinism bench", unit="run") as bar:
        for name, task in tasks:
            bar.set_postfix_str(name)
            result = task()
            if name != "warmup":
                results.append(result)
            bar.update()
    return results


def summarize(runs: list[RunResult], plan: Plan) -> dict:
    ordinary = [r for r in runs if r.label == "fraction" and r.fraction == 0.0]
    base = statistics.mean(r.tokens_per_s for r in ordinary)
    base_cpu = statistics.mean(r.tokens_per_cpu_s for r in ordinary)
    by_fraction = {}
    for f in FRACTIONS:
        rs = [r for r in runs if r.label == "fraction" and r.fraction == f]
        by_fraction[f"{f:.0%}"] = {
            "tokens_per_s": statistics.mean(r.tokens_per_s for r in rs),
            "relative": statistics.mean(r.tokens_per_s for r in rs) / base,
            "tokens_per_cpu_s": statistics.mean(r.tokens_per_cpu_s for r in rs),
            "relative_cpu": statistics.mean(r.tokens_per_cpu_s for r in rs) / base_cpu,
            "det_latency_p50_s": _pct(sum((r.latencies_det for r in rs), []), 0.5),
            "det_latency_p99_s": _pct(sum((r.latencies_det for r in rs), []), 0.99),
            "ordinary_latency_p50_s": _pct(sum((r.latencies_ord for r in rs), []), 0.5),
            "ordinary_latency_p99_s": _pct(sum((r.latencies_ord for r in rs), []), 0.99),
            "rollback_pct": _rollback_pct(rs),
            "verify_time_share": statistics.mean(r.metrics["verify_time_share"] for r in rs),
        }
    baselines = {
        r.label: {"tokens_per_s": r.tokens_per_s, "relative": r.tokens_per_s / base,
                  "tokens_per_cpu_s": r.tokens_per_cpu_s, "relative_cpu": r.tokens_per_cpu_s / base_cpu,
                  "truncated": r.truncated}
        for r in runs if r.label in ("fixed-shape-everything", "one-at-a-time")
    }  # fmt: skip
    windows = {
        str(r.window): {"rollback_pct": _rollback_pct([r]), "relative": r.tokens_per_s / base,
                        "relative_cpu": r.tokens_per_cpu_s / base_cpu,
                        "verify_time_share": r.metrics["verify_time_share"]}
        for r in runs if r.label == "window"
    }  # fmt: skip
    rows = {
        str(r.rows): {"relative": r.tokens_per_s / base, "relative_cpu": r.tokens_per_cpu_s / base_cpu,
                      "verify_time_share": r.metrics["verify_time_share"]}
        for r in runs if r.label == "rows"
    }  # fmt: skip
    best = max((b["tokens_per_cpu_s"] for b in baselines.values()), default=0.0)
    # Judged on CPU time: on a shared machine wall time measures the neighbours too.
    targets = {f"{f:.0%}": {"at_least": t, "met": by_fraction[f"{f:.0%}"]["relative_cpu"] >= t} for f, t in TARGETS.items()}
    ahead = {k: v["tokens_per_cpu_s"] > best for k, v in by_fraction.items()}
    return {"all_ordinary_tokens_per_s": base, "all_ordinary_tokens_per_cpu_s": base_cpu, "by_fraction": by_fraction, "baselines": baselines,
            "windows": windows, "rows": rows, "targets": targets, "ahead_of_both_baselines": ahead}  # fmt: skip


def _rollback_pct(runs: list[RunResult]) -> float | None:
    det = sum(r.deterministic_tokens for r in runs)
    return 100.0 * sum(r.metrics["tokens_redone"] for r in runs) / det if det else None


def _fmt(v, digits=2, suffix="") -> str:
    return "—" if v is None else f"{v:.{digits}f}{suffix}"


def markdown(results: dict) -> str:
    s, plan, env, model = results["summary"], results["settings"], results["environment"], results["model"]
    frac_rows = [
        [k, _fmt(v["tokens_per_s"], 1), _fmt(v["relative"], 2, "×"), _fmt(v["tokens_per_cpu_s"], 1),
         _fmt(v["relative_cpu"], 2, "×"), _fmt(v["rollback_pct"], 1, " %"),
         _fmt(v["verify_time_share"] * 100, 1, " %"), _fmt(v["det_latency_p50_s"]), _fmt(v["det_latency_p99_s"]),
         _fmt(v["ordinary_latency_p50_s"]), _fmt(v["ordinary_latency_p99_s"]), "yes" if s["ahead_of_both_baselines"][k] else "no"]
        for k, v in s["by_fraction"].items()
    ]  # fmt: skip
    base_rows = [[k, _fmt(v["tokens_per_s"], 1), _fmt(v["relative"], 3, "×"), _fmt(v["tokens_per_cpu_s"], 1),
                  _fmt(v["relative_cpu"], 3, "×")] for k, v in s["baselines"].items()]  # fmt: skip
    win_rows = [[k, _fmt(v["rollback_pct"], 2, " %"), _fmt(v["relative"], 2, "×"), _fmt(v["relative_cpu"], 2, "×"),
                 _fmt(v["verify_time_share"] * 100, 1, " %")] for k, v in s["windows"].items()]  # fmt: skip
    row_rows = [[k, _fmt(v["relative"], 2, "×"), _fmt(v["relative_cpu"], 2, "×"), _fmt(v["verify_time_share"] * 100, 1, " %")]
                for k, v in s["rows"].items()]  # fmt: skip
    targets = ", ".join(f"{k}: ≥ {v['at_least']}× {'met' if v['met'] else 'NOT met'}" for k, v in s["targets"].items())
    return "\n".join([
        f"# Deterministic mode benchmark ({'quick' if plan['quick'] else 'full'})",
        "",
        f"`{model['arch']}` / `{model['preset']}` preset, fp32, CPU ({env.get('cpu_model', '?')}), {plan['threads']} threads "
        f"(engine and verifier); closed loop of {plan['concurrency']} requests in flight, {plan['requests']} requests, "
        f"prompts {plan['prompt_len'][0]}–{plan['prompt_len'][1]} tokens, replies {plan['new_tokens'][0]}–"
        f"{plan['new_tokens'][1]} tokens, temperature 0.7 seeded; W = {plan['window']}, G = {plan['rows']}; "
        f"torch {env['torch']}.",
        "",
        "## Throughput by deterministic fraction (relative to all-ordinary)",
        "",
        markdown_table(["deterministic", "tok/s", "relative", "tok/CPU-s", "relative (CPU)", "rollback", "verify time",
                        "det p50 s", "det p99 s",
                        "ord p50 s", "ord p99 s", "ahead of (a),(b)"], frac_rows),
        f"All-ordinary: {s['all_ordinary_tokens_per_s']:.1f} tok/s, {s['all_ordinary_tokens_per_cpu_s']:.1f} tok per "
        f"CPU-second. Targets (judged on CPU time, the work itself; "
        f"wall time on a shared machine also measures the neighbours): {targets}.",
        "",
        "## Baselines (every request deterministic)",
        "",
        markdown_table(["baseline", "tok/s", "relative", "tok/CPU-s", "relative (CPU)"], base_rows),
        "(a) every token from a fixed-shape tile pass; (b) one request at a time. Each ran for a fixed time "
        "budget (tokens produced in it / its duration).",
        "",
        "## Window W (50 % deterministic)",
        "",
        markdown_table(["W", "rollback (tokens redone / det tokens)", "relative", "relative (CPU)", "verify time"], win_rows),
        "## Rows per verify pass G (50 % deterministic)",
        "",
        markdown_table(["G", "relative", "relative (CPU)", "verify time"], row_rows),
        f"Load average at start / end: {env['load_average_1_5_15m']} / {results['load_average_at_end']} "
        "(a shared machine: runs are sequential, so load changes hit them unevenly). Full details in the JSON.",
        "",
    ])  # fmt: skip


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [float(k.rstrip("%")) for k in s["by_fraction"]]
    left.plot(xs, [v["relative_cpu"] for v in s["by_fraction"].values()], marker="o", label="decode–verify–rollback")
    for name, b in s["baselines"].items():
        left.axhline(b["relative_cpu"], linestyle="--", label=f"baseline: {name}", color="grey" if "one" in name else "red")
    left.set_xlabel("deterministic requests (%)")
    left.set_ylabel("tokens per CPU-second, relative to all-ordinary")
    left.set_ylim(bottom=0)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    ws = list(s["windows"])
    right.bar(ws, [v["rollback_pct"] or 0.0 for v in s["windows"].values()])
    right.set_xlabel("window W (tokens)")
    right.set_ylabel("tokens redone (% of deterministic tokens)")
    right.grid(True, alpha=0.3, axis="y")
    m = results["model"]
    fig.suptitle(f"{m['arch']} / {m['preset']} on CPU ({results['settings']['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    env = environment_info() | {"cpu_model": _cpu_model()}
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
