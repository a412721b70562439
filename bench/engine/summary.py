"""The engine benchmark's figures: medians, paired ratios, fractions of the roofline, targets."""

from __future__ import annotations

import statistics

from bench.engine.plan import PREFILL_BUDGET, TARGETS, Plan
from bench.engine.sides import Run, Side
from bench.kit.roofline import forward_key


def _median(runs: list[Run], side: Side, metric: str, **where) -> float | None:
    values = [getattr(r, metric) for r in runs if r.side is side and all(getattr(r, k) == v for k, v in where.items())]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_ratios(runs: list[Run], metric: str, other: Side, concurrency: int) -> dict[str, float] | None:
    """Ours over `other`, repeat by repeat: the two runs of a repeat follow each other, so a slow
    spell of the machine (bench.kit.roofline.host_speed) mostly hits both. The spread of these ratios
    says how far one repeat can move a ratio of medians."""
    by_repeat = {(r.side, r.repeat): getattr(r, metric) for r in runs if r.concurrency == concurrency}
    ratios = [
        value / by_repeat[(other, repeat)]
        for (side, repeat), value in by_repeat.items()
        if side is Side.OURS and by_repeat.get((other, repeat))
    ]
    return _spread(ratios)


def summarize(runs: list[Run], long_runs: list[Run], plan: Plan, roof: dict) -> dict:
    # The fp32 sides, compared like for like; ours-int8 has its own rows (`_int8_summary`).
    sides = sorted({r.side for r in runs} - {Side.OURS_INT8}, key=list(Side).index)
    out: dict = {}
    for metric in ("decode_tokens_per_s", "prefill_tokens_per_s", "e2e_tokens_per_s"):
        per_side = {s.value: {str(c): _median(runs, s, metric, concurrency=c) for c in plan.concurrency} for s in sides}
        out[metric] = per_side
        for other in sides[1:]:
            out[f"{metric}_ratio_vs_{other.value}"] = {
                str(c): _ratio(per_side["ours"][str(c)], per_side[other.value][str(c)]) for c in plan.concurrency
            }
            out[f"{metric}_paired_ratio_vs_{other.value}"] = {
                str(c): paired_ratios(runs, metric, other, c) for c in plan.concurrency
            }
        out[f"{metric}_fraction_of_roofline"] = {
            s.value: {str(c): _fraction(metric, per_side[s.value][str(c)], c, plan, roof) for c in plan.concurrency}
            for s in sides
        }
    long_sides = sorted({r.side for r in long_runs}, key=list(Side).index)
    out["long_context_decode_tokens_per_s"] = {
        s.value: {
            str(h): _median(long_runs, s, "decode_tokens_per_s", prompt_tokens=h * plan.long_concurrency)
            for h in plan.long_histories
        }
        for s in long_sides
    }
    if Side.VLLM in long_sides:
        long = out["long_context_decode_tokens_per_s"]
        out["long_context_ratio_vs_vllm"] = {str(h): _ratio(long["ours"][str(h)], long["vllm"][str(h)]) for h in plan.long_histories}
    out["host_gflops"] = {
        s.value: _spread([r.host_gflops for r in runs + long_runs if r.side is s and r.host_gflops is not None])
        for s in sorted({r.side for r in runs + long_runs}, key=list(Side).index)
    }
    out["targets"] = _targets(out, plan, sides)
    if any(r.side is Side.OURS_INT8 for r in runs):
        out["int8"] = _int8_summary(runs, plan)
    return out


def _int8_summary(runs: list[Run], plan: Plan) -> dict:
    """Ours with int8 weights against ours on fp32 weights, per metric and concurrency."""
    out: dict = {}
    for metric in ("decode_tokens_per_s", "prefill_tokens_per_s", "e2e_tokens_per_s"):
        out[metric] = {}
        for c in plan.concurrency:
            int8, fp32 = _median(runs, Side.OURS_INT8, metric, concurrency=c), _median(runs, Side.OURS, metric, concurrency=c)
            out[metric][str(c)] = {"int8": int8, "fp32": fp32, "int8_over_fp32": _ratio(int8, fp32)}
    return out


def _prefill_forward(c: int, plan: Plan) -> tuple[int, int]:
    """(tokens, sequences) of one of our prefill steps for c prompts: up to the token budget."""
    tokens = min(c * plan.prompt_len, PREFILL_BUDGET)
    return tokens, max(1, tokens // plan.prompt_len)


def _fraction(metric: str, value: float | None, c: int, plan: Plan, roof: dict) -> float | None:
    if value is None:
        return None
    decode_ceiling = roof[forward_key(c, c)]["tokens_per_s"]
    prefill_ceiling = roof[forward_key(*_prefill_forward(c, plan))]["tokens_per_s"]
    if metric == "decode_tokens_per_s":
        return value / decode_ceiling
    if metric == "prefill_tokens_per_s":
        return value / prefill_ceiling
    generated = c * plan.new_tokens  # e2e: the floor is the prefill floor plus the decode floor
    floor = c * plan.prompt_len / prefill_ceiling + (generated - c) / decode_ceiling
    return value / (generated / floor)


def _targets(s: dict, plan: Plan, sides: list[Side]) -> dict:
    checks: dict[str, dict] = {}
    big = [str(c) for c in plan.concurrency if c >= 8]

    def check(name: str, metric: str, peer: Side, keys: list[str]) -> None:
        ratios, paired = s[f"{metric}_ratio_vs_{peer.value}"], s[f"{metric}_paired_ratio_vs_{peer.value}"]
        values = {k: ratios[k] for k in keys if ratios.get(k) is not None}
        if values:
            checks[name] = {
                "at_least": TARGETS[name], "ratios": values, "met": all(v >= TARGETS[name] for v in values.values()),
                "paired": {k: paired[k] for k in values},
            }  # fmt: skip

    if Side.VLLM in sides:
        check("decode_vs_vllm_at_c_ge_8", "decode_tokens_per_s", Side.VLLM, big)
        check("decode_vs_vllm_at_c_1", "decode_tokens_per_s", Side.VLLM, ["1"])
        check("prefill_vs_vllm", "prefill_tokens_per_s", Side.VLLM, [str(c) for c in plan.concurrency])
        check("e2e_vs_vllm_at_c_ge_8", "e2e_tokens_per_s", Side.VLLM, big)
    check("decode_vs_transformers_at_c_ge_8", "decode_tokens_per_s", Side.TRANSFORMERS, big)
    return checks
