"""The determinism benchmark's plans, jobs and runs."""

from __future__ import annotations

import gc
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

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
