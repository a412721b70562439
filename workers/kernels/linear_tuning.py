"""Weight matmuls on the fastest backend this CPU has for each weight shape and batch size.

`F.linear` (MKL sgemm on the weight as loaded) is the reference. Two backends multiply a copy
of the weight packed once at start-up: oneDNN's blocked layout, and our own few-row kernel
(`csrc/panel_gemm.cpp`: 16-column k-major panels, every loaded weight vector used by all the
rows, built at start-up). At decode's 1-16 rows a linear is a pass over its weight and what
counts is streaming it at memory bandwidth, where sgemm is several times slower; at prefill's
hundreds of rows it is compute-bound and sgemm or oneDNN win. Which wins depends on the shape
and the CPU (AVX2 here, AVX-512/AMX elsewhere), so the choice is measured, never assumed: at
start-up every distinct weight shape is timed on each backend for each row bucket, and the
model's linears then dispatch on the number of rows.

    rows of x:     1    2    3-4  5-8  ...  129-256  257-1024  >1024
    bucket:        1    2    4    8    ...  256      1024      1024 (the last bucket covers the rest)
    choice:      PANELS ...        ONEDNN_PACKED TORCH     (per weight shape, measured here)

    plan = tune_linears(model)             # measured once per process per shape, then cached
    install_tuned_linears(model, plan)     # nn.Linear -> TunedLinear (same parameters): tuned_linear.py
    remove_tuned_linears(model)            # back to plain nn.Linear: the reference everywhere

The plan (which backend per shape and bucket, and the int8 mode's) is `linear_plan.py`.

Only the fast path changes: the deterministic verifier multiplies `layer.weight` with
`F.linear` itself, so its fixed-shape results never depend on what was measured here.
A packed weight is a copy: install after the weights are loaded (the runner does). A weight
keeps one packed copy per packed backend its plan picks for some bucket (at most two beside
the original; measured on a 2-core AVX2 host: panels for every bucket, the prefill buckets on
the panel kernel's blocked path);
measuring holds at most `pass_bytes` of packed copies per packed backend (one shape at a time).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping

import torch
from torch import nn

from workers.kernels.linear_backends import BoundLinear, LinearBackend, available_backends, bind, pack_for
from workers.kernels.linear_plan import LinearKey, LinearPlan, LinearTuning, Timings, linears_of

log = logging.getLogger(__name__)


# (key, number of weights, tuning, threads, backends) -> per-bucket choices and timings: once per process.
_measured: dict[tuple, tuple[tuple[LinearBackend, ...], tuple[Timings, ...]]] = {}


def tune_linears(model: nn.Module, tuning: LinearTuning | None = None) -> LinearPlan:
    """Measure each distinct fp32 CPU weight shape of the model on every backend and bucket.

    Bounded: at most `samples` interleaved timings and about `bucket_budget_s` per shape and
    bucket, buckets up to 1,024 rows (larger prefill chunks follow the last bucket: by then
    every backend is compute-bound), and `total_budget_s` in all, checked between timed
    calls. Shapes go one at a time (only one shape's packed copies exist at once, at most
    `pass_bytes` of them), each with an even share of the time left; its buckets go smallest
    first (decode's are the ones that matter most), and a bucket left unmeasured when its
    share runs out takes the shape's previous choice.
    Other dtypes and devices, or a process with no packed backend, keep the reference.
    """
    tuning = tuning or LinearTuning()
    threads = torch.get_num_threads()
    by_shape: dict[LinearKey, list[nn.Linear]] = {}
    for m in linears_of(model):
        by_shape.setdefault(LinearKey.of(m), []).append(m)
    fixed = (LinearBackend.TORCH,) * len(tuning.buckets)
    backends = available_backends()
    tunable = {
        key: linears
        for key, linears in by_shape.items()
        if len(backends) > 1 and key.dtype == torch.float32 and linears[0].weight.device.type == "cpu"
    }
    pending = {key: ls for key, ls in tunable.items() if (key, len(ls), tuning, threads, backends) not in _measured}
    start = time.perf_counter()
    for key, result in _measure_all(pending, tuning, backends).items():
        _measured[(key, len(pending[key]), tuning, threads, backends)] = result
    choices = {key: fixed for key in by_shape}
    timings = {}
    for key, linears in tunable.items():
        choices[key], timings[key] = _measured[(key, len(linears), tuning, threads, backends)]
    plan = LinearPlan(tuning, choices, timings)
    if pending:
        log.info("linear backends: %d shapes measured in %.1f s, %d threads (?: untimed)\n  %s",
                 len(pending), time.perf_counter() - start, threads, "\n  ".join(plan.describe()))  # fmt: skip
        if guessed := plan.unmeasured():
            # Not an error (every backend gives correct results), but a slower one may sit
            # where a bucket went untimed: say which, so a busy start-up's plan is not taken
            # for a measured one.
            log.warning("linear tuning ran out of its %.1f s budget: %d of %d shapes have untimed buckets (%s)",
                        tuning.total_budget_s, len(guessed), len(tunable),
                        "; ".join(f"{k.out_features}x{k.in_features}: {list(b)}"
                                  for k, b in guessed.items()))  # fmt: skip
    return plan


class _ShapeBench:
    """Weights of one shape and their packed copies, timed on every backend.

    In a forward pass every weight is read once, from memory rather than from the caches
    (the model is far bigger than the L3), which is what decides small batches: up to
    `pass_rows` rows one timed call is a pass over the shape's weights in model order, as
    many as fit in `pass_bytes` (enough to leave the caches behind, bounded in memory and
    time on a big model); beyond, the matmul is compute-bound and one weight stands for all.
    """

    def __init__(self, linears: list[nn.Linear], tuning: LinearTuning, backends: tuple[LinearBackend, ...]):
        weight = linears[0].weight
        fit = max(1, tuning.pass_bytes // (weight.numel() * weight.element_size()))
        self.backends = backends
        self.out_features = weight.shape[0]
        # A pass holds `fit` weights: the shape's own, then copies of them when the model has
        # few of this shape, so every pass leaves the caches behind (a shape with four 1 MB
        # weights would otherwise be timed out of the L3, where backends rank differently).
        # At most MAX_PASS_COPIES weights per pass come from copies: tiny weights (far below a
        # megabyte) stay cheap to time, at the price of being timed nearer the caches.
        originals = [(m.weight.detach(), None if m.bias is None else m.bias.detach()) for m in linears]
        fit = min(fit, max(len(originals), MAX_PASS_COPIES))
        chosen = [originals[i % len(originals)] for i in range(fit)]
        self.weights = [w if i < len(originals) else w.clone() for i, (w, _) in enumerate(chosen)]
        biases = [b for _, b in chosen]
        # Bound once, as TunedLinear and the decode program call them: timed without the lookups.
        self.bound: dict[LinearBackend, list[BoundLinear]] = {
            backend: [
                bind(backend, w, pack_for(backend, w) if backend.packed else None, b, self.out_features)
                for w, b in zip(self.weights, biases)
            ]
            for backend in backends
        }

    def run(self, backend: LinearBackend, x: torch.Tensor, n: int) -> None:
        for fn, args in self.bound[backend][:n]:
            fn(x, *args)

    def measure(
        self, rows: int, tuning: LinearTuning, stop: float, held: LinearBackend | None
    ) -> tuple[LinearBackend, Timings] | None:
        """The backend for `rows` (`choose`) and the timings, or None when `stop` (a
        perf_counter time) came before one timed call of each backend."""
        x = torch.randn(rows, self.weights[0].shape[1], dtype=self.weights[0].dtype)
        n = len(self.weights) if rows <= tuning.pass_rows else 1
        samples: dict[LinearBackend, list[float]] = {b: [] for b in self.backends}
        for backend in self.backends:  # warm-up: first touch, oneDNN primitive creation
            self.run(backend, x, 1)
        deadline = min(stop, time.perf_counter() + tuning.bucket_budget_s)
        for sample in range(tuning.samples):
            if time.perf_counter() > stop:
                break
            # Interleaved, so all see the same moments of a shared machine, and in a rotating
            # order, so none always runs right after the same neighbour.
            k = sample % len(self.backends)
            for backend in self.backends[k:] + self.backends[:k]:
                start = time.perf_counter()
                self.run(backend, x, n)
                samples[backend].append((time.perf_counter() - start) / n)
            if sample + 1 >= MIN_ROUNDS and time.perf_counter() > deadline:
                break
        if any(not times for times in samples.values()):
            return None
        # The median of the rounds: on a shared machine a preempted call (a thread descheduled
        # inside a parallel region costs milliseconds) can land on any backend; the median of
        # at least MIN_ROUNDS rounds ignores it as long as most rounds ran clean.
        typical = {b: statistics.median(times) for b, times in samples.items()}
        return choose(typical, held, tuning.min_gain), {b: t * 1e6 for b, t in typical.items()}


MIN_ROUNDS = 5  # rounds per bucket before its time budget may end it
MAX_PASS_COPIES = 64  # weights per timed pass when a shape's own are too few to fill pass_bytes


def choose(typical: Mapping[LinearBackend, float], held: LinearBackend | None, min_gain: float) -> LinearBackend:
    """The backend for one bucket from typical times (lower is faster).

    Each packed backend a shape uses keeps a copy of its weights, so the backends that need no
    new copy (F.linear on the weight as loaded, and `held`: the packed backend the shape already
    chose for a smaller bucket) win unless another is `min_gain` faster than the faster of them.
    Whatever wins is thus never `min_gain` slower than the fastest measured.
    """
    free = [b for b in (LinearBackend.TORCH, held) if b in typical]
    best_free = min(free, key=typical.__getitem__)
    fastest = min(typical, key=typical.__getitem__)
    return best_free if typical[best_free] <= typical[fastest] * min_gain else fastest


def _measure_all(
    pending: dict[LinearKey, list[nn.Linear]], tuning: LinearTuning, backends: tuple[LinearBackend, ...]
):
    results = {}
    stop = time.perf_counter() + tuning.total_budget_s
    with torch.inference_mode():
        for done, (key, linears) in enumerate(pending.items()):
            now = time.perf_counter()
            share = now + max(0.0, stop - now) / (len(pending) - done)  # this shape's end
            bench = _ShapeBench(linears, tuning, backends) if now < share else None
            picks: list[LinearBackend] = []
            times: list[Timings] = []
            for rows in tuning.buckets:
                measured = None
                if bench is not None and time.perf_counter() < share:
                    held = next((p for p in picks if p.packed), None)
                    measured = bench.measure(rows, tuning, share, held)
                choice, us = measured or ((picks[-1] if picks else LinearBackend.TORCH), {})
                picks.append(choice)
                times.append(us)
            del bench  # its packed copies: one shape's at a time
            results[key] = (tuple(picks), tuple(times))
    return results
