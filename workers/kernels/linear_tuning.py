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
    install_tuned_linears(model, plan)     # nn.Linear -> TunedLinear (same parameters)
    remove_tuned_linears(model)            # back to plain nn.Linear: the reference everywhere

Only the fast path changes: the deterministic verifier multiplies `layer.weight` with
`F.linear` itself, so its fixed-shape results never depend on what was measured here.
A packed weight is a copy: install after the weights are loaded (the runner does). A weight
keeps one packed copy per packed backend its plan picks for some bucket (at most two beside
the original; measured on a 2-core AVX2 host: panels for every bucket, the prefill buckets on
the panel kernel's blocked path);
measuring holds at most `pass_bytes` of packed copies per packed backend (one shape at a time).
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import linear_backends
from workers.kernels.huge_pages import on_huge_pages
from workers.kernels.linear_backends import (
    BoundLinear,
    LinearBackend,
    Packed,
    available_backends,
    bind,
    pack_for,
)
from workers.kernels.extensions import panel_kernels

log = logging.getLogger(__name__)
panel_build_failure = panel_kernels.failure  # why the panel kernel did not build, if it did not


@dataclass(frozen=True)
class LinearTuning:
    # Up to 256 rows (decode batches, short prompt chunks) a bucket per power of two; steps of
    # 257 rows up to the token budget (2,048 by default: long prompt chunks) share one bucket,
    # measured at 1,024 rows: which backend wins there is often not the 256-row winner (tuner
    # medians here, 2 threads: NemotronH's 2576x512 on oneDNN 20.2 ms vs 23.7 on the panel kernel
    # picked at 256 rows; 512x1024 8.6 vs 10.4 on F.linear). Measured last: a start-up that runs
    # out of time leaves it on the 256-row choice (`LinearPlan.unmeasured`).
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
    # Timed calls per backend and bucket, interleaved so all backends see the same moments
    # of a shared machine; the median counts (see _ShapeBench.measure).
    samples: int = 25
    bucket_budget_s: float = 0.03  # stop sampling a bucket after this long (at least MIN_ROUNDS rounds)
    total_budget_s: float = 10.0  # all shapes and buckets; a loaded machine must not stall start-up
    pass_rows: int = 16  # up to this many rows, time passes over many weights of a shape (see _ShapeBench)
    pass_bytes: int = 64 << 20  # the weights of one timed pass: well beyond the caches, bounded memory
    min_gain: float = 1.05  # a packed backend must beat F.linear by this factor to be chosen

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] != 1:
            raise ValueError(f"buckets must be strictly increasing from 1, got {self.buckets}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.pass_rows < 0:
            raise ValueError(f"pass_rows must be >= 0, got {self.pass_rows}")
        if self.pass_bytes < 1:
            raise ValueError(f"pass_bytes must be >= 1, got {self.pass_bytes}")
        if self.bucket_budget_s <= 0 or self.total_budget_s <= 0:
            raise ValueError(f"time budgets must be > 0, got {self.bucket_budget_s}, {self.total_budget_s}")
        if self.min_gain < 1.0:
            raise ValueError(f"min_gain must be >= 1, got {self.min_gain}")

    def bucket_index(self, rows: int) -> int:
        """The smallest bucket holding `rows`; the last bucket for anything larger."""
        return min(bisect.bisect_left(self.buckets, rows), len(self.buckets) - 1)


@dataclass(frozen=True)
class LinearKey:
    """What a tuning decision depends on: one weight shape (and dtype, and whether it has a bias)."""

    out_features: int
    in_features: int
    bias: bool
    dtype: torch.dtype

    @staticmethod
    def of(linear: nn.Linear) -> LinearKey:
        return LinearKey(linear.out_features, linear.in_features, linear.bias is not None, linear.weight.dtype)


Timings = dict[LinearBackend, float]  # median µs per weight; empty where the total budget ran out


@dataclass(frozen=True)
class LinearPlan:
    """One backend per bucket for each weight shape, and the timings (µs) behind the choice."""

    tuning: LinearTuning
    choices: Mapping[LinearKey, tuple[LinearBackend, ...]]
    timings_us: Mapping[LinearKey, tuple[Timings, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, per_bucket in self.choices.items():
            if len(per_bucket) != len(self.tuning.buckets):
                raise ValueError(f"{key}: {len(per_bucket)} choices for {len(self.tuning.buckets)} buckets")

    @staticmethod
    def fixed(model: nn.Module, backend: LinearBackend, tuning: LinearTuning | None = None) -> LinearPlan:
        """The same backend for every weight and bucket (tests pin each path this way)."""
        tuning = tuning or LinearTuning()
        keys = {LinearKey.of(m) for m in _linears(model)}
        return LinearPlan(tuning, {k: (backend,) * len(tuning.buckets) for k in keys})

    @property
    def quantized(self) -> bool:
        """Whether any weight runs on int8 panels (the engine's int8 mode)."""
        return any(LinearBackend.PANELS_INT8 in per_bucket for per_bucket in self.choices.values())

    def describe(self) -> list[str]:
        """One line per weight shape: the backend of each bucket, `?` after a choice taken
        without timing (the start-up ran out of its tuning budget first)."""
        lines, unmeasured = [], self.unmeasured()
        for key, per_bucket in sorted(self.choices.items(), key=lambda kv: (kv[0].out_features, kv[0].in_features)):
            guessed = unmeasured.get(key, ())
            picks = " ".join(
                f"{b}:{c.name}{'?' if b in guessed else ''}" for b, c in zip(self.tuning.buckets, per_bucket)
            )
            lines.append(f"{key.out_features}x{key.in_features}: {picks}")
        return lines

    def unmeasured(self) -> dict[LinearKey, tuple[int, ...]]:
        """The buckets of each tuned shape that were never timed (they took a smaller bucket's
        choice, or the reference): on a busy start-up the total budget ends before the last."""
        out = {}
        for key, per_bucket in self.timings_us.items():
            missing = tuple(b for b, timings in zip(self.tuning.buckets, per_bucket) if not timings)
            if missing:
                out[key] = missing
        return out


INT8_MAX_ROWS = 64  # the int8 mode's int8 weights serve batches up to this many rows


def int8_plan(
    model: nn.Module, fp32: LinearPlan | None = None, max_rows: int | None = INT8_MAX_ROWS
) -> LinearPlan:
    """The int8 mode's plan: every fp32 linear of `model` on int8 panels for batches of up to
    `max_rows` rows, and beyond on `fp32`'s choice (F.linear without one); `max_rows=None`: int8
    at every row count (what `bench.int8_accuracy` measures).

    Why not int8 everywhere: int8 weights pay where a matmul streams its weight (decode, up to
    a few dozen rows: 2.4x faster at one row here); a prefill chunk of hundreds of rows is
    compute-bound, where int8 only adds widening work and sgemm/oneDNN are faster (measured
    0.75x of fp32 at 1,024 rows). Prompts are thus processed on the fp32 weights, generated
    tokens on int8. Raises at start-up when the panel kernel cannot be built here."""
    if linear_backends.panel_kernels() is None:
        raise RuntimeError(
            f"weight_quantization=int8 needs the panel kernel, which did not build: {panel_build_failure()}"
        )
    tuning = fp32.tuning if fp32 is not None else LinearTuning()
    torch_only = (LinearBackend.TORCH,) * len(tuning.buckets)
    choices = {}
    for key in LinearPlan.fixed(model, LinearBackend.TORCH, tuning).choices:
        beyond = fp32.choices.get(key, torch_only) if fp32 is not None else torch_only
        if key.dtype != torch.float32:
            choices[key] = torch_only
            continue
        choices[key] = tuple(
            LinearBackend.PANELS_INT8 if max_rows is None or bucket <= max_rows else beyond[i]
            for i, bucket in enumerate(tuning.buckets)
        )
    return LinearPlan(tuning, choices)


class TunedLinear(nn.Linear):
    """An nn.Linear (the same weight and bias parameters) that runs each call on its plan's
    backend for that many rows."""

    def __init__(self, linear: nn.Linear, choices: tuple[LinearBackend, ...], tuning: LinearTuning):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.tuning, self.choices = tuning, choices
        packed = [b for b in dict.fromkeys(choices) if b.packed]
        self.packs: dict[LinearBackend, Packed] = {b: pack_for(b, self.weight) for b in packed}
        self.bound = self._bind()

    def _bind(self) -> tuple[BoundLinear, ...]:
        """Per bucket, the backend's function and its arguments after x (`linear_backends.bind`)."""
        return tuple(bind(b, self.weight, self.packs.get(b), self.bias, self.out_features) for b in self.choices)

    def streamed(self) -> list[torch.Tensor]:
        """The dense tensors a call may stream: the weight and the packed copies (oneDNN's
        opaque ones excepted), in the order `adopt` takes their replacements."""
        found = [self.weight.data]

        def collect(t: torch.Tensor) -> torch.Tensor:
            found.append(t)
            return t

        for pack in self.packs.values():
            _map_dense(pack, collect)
        return found

    def adopt(self, copies: Iterator[torch.Tensor]) -> None:
        """Use `copies` (equal values, `streamed` order) in place of the streamed tensors."""
        self.weight.data = next(copies)  # the same Parameter: the reference path shares it
        self.packs = {b: _map_dense(pack, lambda _: next(copies)) for b, pack in self.packs.items()}
        self.bound = self._bind()

    def backend_for(self, rows: int) -> LinearBackend:
        return self.choices[self.tuning.bucket_index(rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not rows:
            return F.linear(x, self.weight, self.bias)
        fn, args = self.bound[self.tuning.bucket_index(rows)]
        return fn(x, *args)


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
    for m in _linears(model):
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


def _map_dense(pack: Packed, fn: Callable[[torch.Tensor], torch.Tensor]) -> Packed:
    """`pack` with each dense tensor t, in order, replaced by fn(t); oneDNN's opaque ones kept.
    The one walk `TunedLinear.streamed` and `adopt` share, so their orders cannot drift apart."""
    if isinstance(pack, tuple):
        return tuple(_map_dense(t, fn) for t in pack)
    return fn(pack) if pack.layout == torch.strided else pack


def install_tuned_linears(model: nn.Module, plan: LinearPlan) -> None:
    """Replace every linear of the model by a TunedLinear following the plan (weights shared),
    and put the CPU ones' weights and packed copies on huge pages (`huge_pages`)."""
    tuned = []
    for parent, name, linear in _linear_children(model):
        choices = plan.choices.get(LinearKey.of(linear), (LinearBackend.TORCH,) * len(plan.tuning.buckets))
        tuned.append(TunedLinear(linear, choices, plan.tuning))
        setattr(parent, name, tuned[-1])
    on_cpu = [t for t in tuned if t.weight.device.type == "cpu"]
    copies = iter(on_huge_pages([tensor for t in on_cpu for tensor in t.streamed()]))
    for t in on_cpu:
        t.adopt(copies)


def remove_tuned_linears(model: nn.Module) -> None:
    """Put plain nn.Linear modules back (the same parameters): the reference path."""
    for parent, name, linear in _linear_children(model):
        if isinstance(linear, TunedLinear):
            plain = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(plain)
            plain.in_features, plain.out_features = linear.in_features, linear.out_features
            plain.weight, plain.bias = linear.weight, linear.bias
            setattr(parent, name, plain)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _linear_children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
