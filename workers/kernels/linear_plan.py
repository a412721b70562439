"""Which backend runs each weight shape at each batch size: the plan the tuning measures
(`linear_tuning.tune_linears`), a fixed one (tests, the reference), or the int8 mode's.

    rows of x:     1    2    3-4  5-8  ...  129-256  257-1024  >1024
    bucket:        1    2    4    8    ...  256      1024      1024 (the last bucket covers the rest)

    plan = LinearPlan.fixed(model, LinearBackend.PANELS)   # one backend everywhere
    plan = int8_plan(model, fp32_plan)                       # int8 panels up to INT8_MAX_ROWS rows
    plan.choices[LinearKey.of(linear)][tuning.bucket_index(rows)]   -> the backend
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from workers.kernels import linear_backends
from workers.kernels.extensions import panel_kernels
from workers.kernels.linear_backends import LinearBackend

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
        keys = {LinearKey.of(m) for m in linears_of(model)}
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


def linears_of(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]
