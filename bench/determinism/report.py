"""The determinism benchmark's figures, Markdown and plot."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.determinism.run import FRACTIONS, TARGETS, Plan, RunResult
from bench.kit.stats import rounded_rank
from bench.kit.tables import markdown_table


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
            "det_latency_p50_s": rounded_rank(sum((r.latencies_det for r in rs), []), 0.5),
            "det_latency_p99_s": rounded_rank(sum((r.latencies_det for r in rs), []), 0.99),
            "ordinary_latency_p50_s": rounded_rank(sum((r.latencies_ord for r in rs), []), 0.5),
            "ordinary_latency_p99_s": rounded_rank(sum((r.latencies_ord for r in rs), []), 0.99),
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
