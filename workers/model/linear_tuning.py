"""Weight matmuls on the fastest backend this CPU has for each weight shape and batch size.

`F.linear` (MKL sgemm on the weight as loaded) is the reference. oneDNN can reorder a weight
once into its blocked layout and then multiply small batches near memory bandwidth, where
sgemm at 2-64 rows is several times slower; at one row sgemm's gemv is often the faster one,
and which wins depends on the shape and the CPU (AVX2 here, AVX-512/AMX elsewhere). So the
choice is measured, never assumed: at start-up every distinct weight shape is timed on each
backend for each row bucket, and the model's linears then dispatch on the number of rows.

    rows of x:     1    2    3-4  5-8  ...  129-256  >256
    bucket:        1    2    4    8    ...  256      256 (the last bucket covers the rest)
    choice:      TORCH PACKED ...            (per weight shape, measured here)

    plan = tune_linears(model)             # measured once per process per shape, then cached
    install_tuned_linears(model, plan)     # nn.Linear -> TunedLinear (same parameters)
    remove_tuned_linears(model)            # back to plain nn.Linear: the reference everywhere

Only the fast path changes: the deterministic verifier multiplies `layer.weight` with
`F.linear` itself, so its fixed-shape results never depend on what was measured here.
A packed weight is a copy: install after the weights are loaded (the runner does).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

class LinearBackend(Enum):
    TORCH = "torch"  # F.linear on the weight as loaded: the reference
    ONEDNN_PACKED = "onednn_packed"  # oneDNN matmul on the weight reordered once into its blocked layout


@dataclass(frozen=True)
class LinearTuning:
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    # Timed single calls per backend and bucket, interleaved so both backends see the same
    # moments of a shared machine; the minimum counts (one short call is rarely preempted).
    samples: int = 25
    bucket_budget_s: float = 0.03  # stop sampling a bucket after this long (at least 3 samples)
    pass_rows: int = 16  # up to this many rows, time passes over all weights of a shape (see _measure)
    min_gain: float = 1.05  # a packed backend must beat F.linear by this factor to be chosen

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] != 1:
            raise ValueError(f"buckets must be strictly increasing from 1, got {self.buckets}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.pass_rows < 0:
            raise ValueError(f"pass_rows must be >= 0, got {self.pass_rows}")
        if self.bucket_budget_s <= 0:
            raise ValueError(f"bucket_budget_s must be > 0, got {self.bucket_budget_s}")
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


@dataclass(frozen=True)
class LinearPlan:
    """One backend per bucket for each weight shape, and the timings (µs) behind the choice."""

    tuning: LinearTuning
    choices: Mapping[LinearKey, tuple[LinearBackend, ...]]
    timings_us: Mapping[LinearKey, tuple[dict[LinearBackend, float], ...]] = field(default_factory=dict)

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

    def describe(self) -> list[str]:
        """One line per weight shape: the backend of each bucket."""
        lines = []
        for key, per_bucket in sorted(self.choices.items(), key=lambda kv: (kv[0].out_features, kv[0].in_features)):
            picks = " ".join(f"{b}:{c.name}" for b, c in zip(self.tuning.buckets, per_bucket))
            lines.append(f"{key.out_features}x{key.in_features}: {picks}")
        return lines


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (a copy; no batch-size hint, so one pack serves all)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class TunedLinear(nn.Linear):
    """An nn.Linear (the same weight and bias parameters) that runs each call on its plan's
    backend for that many rows."""

    def __init__(self, linear: nn.Linear, choices: tuple[LinearBackend, ...], tuning: LinearTuning):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.tuning, self.choices = tuning, choices
        self.packed = pack_weight(self.weight) if LinearBackend.ONEDNN_PACKED in choices else None

    def backend_for(self, rows: int) -> LinearBackend:
        return self.choices[self.tuning.bucket_index(rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.packed is not None and rows and self.backend_for(rows) is LinearBackend.ONEDNN_PACKED:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


# (key, number of weights, tuning, threads) -> per-bucket choices and timings: measured once per process.
_measured: dict[tuple, tuple[tuple[LinearBackend, ...], tuple[dict[LinearBackend, float], ...]]] = {}


def tune_linears(model: nn.Module, tuning: LinearTuning | None = None) -> LinearPlan:
    """Measure each distinct fp32 CPU weight shape of the model on every backend and bucket.

    Bounded: at most `samples` interleaved timings and about `bucket_budget_s` per shape and
    bucket, buckets up to 256 rows (larger prefill chunks follow the last bucket: by then
    both backends are compute-bound).
    Other dtypes and devices, or a torch without oneDNN, keep the reference.
    """
    tuning = tuning or LinearTuning()
    threads = torch.get_num_threads()
    by_shape: dict[LinearKey, list[nn.Linear]] = {}
    for m in _linears(model):
        by_shape.setdefault(LinearKey.of(m), []).append(m)
    choices, timings = {}, {}
    start = time.perf_counter()
    measured = 0
    for key, linears in by_shape.items():
        tunable = packing_available() and key.dtype == torch.float32 and linears[0].weight.device.type == "cpu"
        if not tunable:
            choices[key] = (LinearBackend.TORCH,) * len(tuning.buckets)
            continue
        cache_key = (key, len(linears), tuning, threads)
        if cache_key not in _measured:
            _measured[cache_key] = _measure(linears, tuning)
            measured += 1
        choices[key], timings[key] = _measured[cache_key]
    plan = LinearPlan(tuning, choices, timings)
    if measured:
        log.info("linear backends: %d shapes measured in %.1f s, %d threads\n  %s",
                 measured, time.perf_counter() - start, threads, "\n  ".join(plan.describe()))  # fmt: skip
    return plan


def _measure(linears: list[nn.Linear], tuning: LinearTuning):
    # In a forward pass every weight is read once, from memory rather than from the caches
    # (the model is far bigger than the L3), which is what decides small batches: up to
    # `pass_rows` rows one timed call is a pass over all the model's weights of this shape,
    # in model order; beyond, the matmul is compute-bound and one weight stands for all.
    weights = [m.weight.detach() for m in linears]
    biases = [None if m.bias is None else m.bias.detach() for m in linears]
    packs = [pack_weight(w) for w in weights]

    def torch_pass(x, n):
        for w, b in zip(weights[:n], biases[:n]):
            F.linear(x, w, b)

    def packed_pass(x, n):
        for p, b in zip(packs[:n], biases[:n]):
            packed_linear(x, p, b)

    runs = {LinearBackend.TORCH: torch_pass, LinearBackend.ONEDNN_PACKED: packed_pass}
    picks, times = [], []
    with torch.inference_mode():
        for rows in tuning.buckets:
            x = torch.randn(rows, linears[0].in_features, dtype=weights[0].dtype)
            n = len(weights) if rows <= tuning.pass_rows else 1
            best = {b: float("inf") for b in runs}
            for fn in runs.values():  # warm-up: first touch, oneDNN primitive creation
                fn(x, 1)
            deadline = time.perf_counter() + tuning.bucket_budget_s
            for sample in range(tuning.samples):
                for backend, fn in runs.items():
                    start = time.perf_counter()
                    fn(x, n)
                    best[backend] = min(best[backend], (time.perf_counter() - start) / n)
                if sample >= 2 and time.perf_counter() > deadline:
                    break
            us = {b: t * 1e6 for b, t in best.items()}
            gain = best[LinearBackend.TORCH] / best[LinearBackend.ONEDNN_PACKED]
            picks.append(LinearBackend.ONEDNN_PACKED if gain >= tuning.min_gain else LinearBackend.TORCH)
            times.append(us)
    return tuple(picks), tuple(times)


def install_tuned_linears(model: nn.Module, plan: LinearPlan) -> None:
    """Replace every linear of the model by a TunedLinear following the plan (weights shared)."""
    for parent, name, linear in _linear_children(model):
        choices = plan.choices.get(LinearKey.of(linear), (LinearBackend.TORCH,) * len(plan.tuning.buckets))
        setattr(parent, name, TunedLinear(linear, choices, plan.tuning))


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
