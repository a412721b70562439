"""bench.engine's summary: ratios of medians, and beside them the ratios within each repeat."""

from collections import defaultdict

import pytest

from bench.engine.plan import Plan
from bench.engine.report import markdown_targets
from bench.engine.sides import Run, Side
from bench.engine.summary import paired_ratios, summarize

PLAN = Plan(concurrency=(1, 8), prompt_len=128, new_tokens=16, repeats=3, long_histories=(), long_concurrency=8,
            long_new_tokens=16)


def _run(side: Side, concurrency: int, repeat: int, prefill_s: float, host: float | None = None) -> Run:
    tokens = PLAN.prompt_len * concurrency
    return Run(side, concurrency, repeat, tokens, PLAN.new_tokens * concurrency, (PLAN.new_tokens - 1) * concurrency,
               prefill_s, 1.0, 2 * prefill_s, 2.0, host)


def _runs() -> list[Run]:
    # Prefill seconds per repeat. Ours: 1, 2, 1 -> tok/s 128, 64, 128; vLLM: 1, 2, 2 -> 128, 64, 64.
    # Medians 128 / 64 = 2.0x; within each repeat 1.0, 1.0, 2.0 (median 1.0).
    runs = [_run(Side.OURS, 1, r, s, host=100.0 + r) for r, s in enumerate((1.0, 2.0, 1.0))]
    runs += [_run(Side.VLLM, 1, r, s, host=90.0 - r) for r, s in enumerate((1.0, 2.0, 2.0))]
    runs += [_run(Side.TRANSFORMERS, 1, r, 4.0) for r in range(3)]
    runs.append(_run(Side.OURS, 1, 3, 0.1))  # a repeat the peer lacks: no pair
    runs += [_run(side, 8, 0, 0.5) for side in (Side.OURS, Side.VLLM, Side.TRANSFORMERS)]  # another concurrency
    return runs


def test_paired_ratios_divide_the_runs_of_one_repeat():
    spread = paired_ratios(_runs(), "prefill_tokens_per_s", Side.VLLM, 1)
    assert spread == pytest.approx({"median": 1.0, "min": 1.0, "max": 2.0, "n": 3})
    assert paired_ratios(_runs(), "prefill_tokens_per_s", Side.VLLM, 8) == pytest.approx(
        {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1})
    assert paired_ratios([r for r in _runs() if r.side is not Side.VLLM], "prefill_tokens_per_s", Side.VLLM, 1) is None


def test_summary_keeps_the_ratio_of_medians_and_shows_the_paired_spread_beside_it():
    roof = defaultdict(lambda: {"tokens_per_s": 1000.0})
    summary = summarize(_runs(), [], PLAN, roof)
    assert summary["prefill_tokens_per_s_ratio_vs_vllm"]["1"] == pytest.approx(
        (128 / 1.0) / (128 / 2.0))  # medians over ours' four runs (128, 64, 128, 1280) and vLLM's three
    target = summary["targets"]["prefill_vs_vllm"]
    assert target["paired"]["1"] == pytest.approx({"median": 1.0, "min": 1.0, "max": 2.0, "n": 3})
    assert summary["host_gflops"]["ours"] == pytest.approx({"median": 101.0, "min": 100.0, "max": 102.0, "n": 3})
    assert summary["host_gflops"]["vllm"] == pytest.approx({"median": 89.0, "min": 88.0, "max": 90.0, "n": 3})
    assert summary["host_gflops"]["transformers"] is None  # runs without a probe reading
    lines = "\n".join(markdown_targets(summary["targets"]))
    assert "c=1: 2.00× [per repeat 1.00×, 1.00–2.00]" in lines
    assert "c=8: 1.00×)" in lines  # one pair at c=8: the ratio alone, no bracket
