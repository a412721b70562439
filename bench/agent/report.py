"""The Markdown and the plot of `bench.agent`, from its JSON alone."""

from __future__ import annotations

from pathlib import Path

from bench.kit.tables import format_number, markdown_table, ms, percent


def _ran(res: dict) -> list[str]:
    return [s for s in res["labels"] if s in res["sides"] and "per_turn" in res["sides"][s]]


def step_table(res: dict) -> list[str]:
    present = _ran(res)
    steps = max((len(res["sides"][s]["per_turn"]) for s in present), default=0)
    rows = []
    for i in range(steps):
        row = [str(i + 1)]
        for s in present:
            pts = res["sides"][s]["per_turn"]
            pt = pts[i] if i < len(pts) else None
            row.append("—" if not pt or not pt["completed"] else
                       f"{ms(pt['ttft_p50_s'])} / {ms(pt['ttft_p99_s'])} "
                       f"({format_number(pt['prompt_tokens_mean'], 0)} tok, hit {percent(pt['hit_ratio'], 1)})")
        rows.append(row)
    if not present:
        return ["No side completed a step.", ""]
    lines = ["Step TTFT p50 / p99 in ms (mean prompt tokens; hit ratio = cached / prompt tokens):", "",
             markdown_table(["step", *[res["labels"][s] for s in present]], rows)]
    summary = [[res["labels"][s], str(r["turns_completed"]), percent(r["cache_hit_ratio"], 1),
                format_number(r["output_tokens_per_s"]), f"{r['wall_s']:.1f}", str(len(r["errors"]))]
               for s in present for r in [res["sides"][s]]]
    lines += [markdown_table(["side", "steps done", "hit ratio", "output tok/s", "wall s", "errors"], summary)]
    routed = [(s, r["route_decisions"]) for s in present for r in [res["sides"][s]] if "route_decisions" in r]
    if routed:
        lines += ["", "Why each request went where it went (`hybridserve_route_decisions_total{reason}` over the side):", ""]
        lines += [f"- {res['labels'][s]}: " + (", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none")
                  + f"; prefix checkpoints imported from the state tier: {res['sides'][s].get('tier_imports', 0)}"
                  for s, d in routed]
    for s, r in res["sides"].items():
        if r.get("startup_error"):
            lines.append(f"- {res['labels'][s]}: did not start: `{r['startup_error'][-300:]}`")
        elif r.get("errors"):
            died = "" if r.get("server_alive_after", True) else " (the server no longer answered /health)"
            lines.append(f"- {res['labels'][s]}: {len(r['errors'])} errors{died}; first: `{r['errors'][0][:300]}`")
    return lines + [""]


def decode_lines(res: dict) -> list[str]:
    d = res["decode"]
    if not d:
        return []
    rows = []
    for kind, rec in d.items():
        for key, label in (("step_gap_s", "mean gap between a request's deltas, whole batch (not judged)"),
                           ("total_s_per_token", "total / output tokens"), ("inter_token_s", "after the first delta")):
            if key in rec:
                m = rec[key]
                rows.append([kind, label, f"{m['on_median'] * 1e3:.1f}", f"{m['off_median'] * 1e3:.1f}",
                             f"{m['overhead']:+.1%}"])
    tokens = {k: (sorted(set(r["completion_tokens"]["on"])), sorted(set(r["completion_tokens"]["off"])))
              for k, r in d.items()}
    return [f"Constrained decoding, {res['plan']['loops']} requests at once, max_tokens "
            f"{res['plan']['decode_max_tokens']}, {res['plan']['decode_rounds']} rounds (method in "
            "bench/agent/decode.py; target <= +10% per token):", "",
            markdown_table(["pair", "ms per token", "grammar on", "grammar off", "extra"], rows),
            "Output tokens per request (on / off): "
            + "; ".join(f"{k} {on} / {off}" for k, (on, off) in tokens.items()) + ".",
            *[f"Rounds whose batch streamed whole ({k}, on / off): {sum(w['on'])}/{len(w['on'])} / "
              f"{sum(w['off'])}/{len(w['off'])} (otherwise each request's mean gap over all its deltas)."
              for k, r in d.items() if (w := r.get("whole_batch_rounds"))], ""]


def headline_lines(res: dict) -> list[str]:
    h, lines = res["headline"], []
    for s, r in h.get("reuse", {}).items():
        lines.append(f"- {res['labels'][s]}: hit ratio from step 2 {percent(r['hit_ratio_from_step_2'], 1)}; "
                     f"step 1 reused the tenant's prefix in {r['step_1_loops_reusing']} of {r['step_1_loops']} "
                     f"loops (cached tokens {r['step_1_cached_tokens']}).")
    for s, r in h["ttft_p50_ratio_over_a"].items():
        target = " (target >= 5x at step 10)" if s.startswith("d") else ""
        lines.append(f"- {res['labels'][s]} over (a) at step {r['step']} ({format_number(r['prompt_tokens'], 0)} "
                     f"prompt tokens), the last both completed: TTFT p50 {ms(r['other_ttft_p50_s'])} / "
                     f"{ms(r['a_ttft_p50_s'])} ms = {r['ratio']:.1f}x{target}.")
    for kind, r in h["decode_overhead"].items():
        lines.append(f"- Constrained decoding, {kind}: {r['overhead']:+.1%} per output token ({r['measure']}; "
                     "target <= +10%).")
    return lines + [""]


def markdown(res: dict) -> str:
    plan, cat = res["plan"], res["catalogue"]
    title = " (smoke)" if plan["preset"] == "tiny" else " (quick)" if res["quick"] else ""
    lines = [f"# Agent-loop benchmark{title}", "",
             f"{plan['loops']} concurrent agent loops x {plan['steps']} steps, GraniteMoeHybrid `{plan['preset']}` "
             f"checkpoint (random weights), greedy, streamed over HTTP with `openai`. Catalogue: {cat['tools']} "
             f"function tools, {cat['tokens']:,} tokens as rendered by the checkpoint's template (first step's "
             f"prompt {cat['first_step_prompt_tokens']:,} tokens); tool results {plan['result_tokens'][0]}-"
             f"{plan['result_tokens'][1]} tokens; each step tool_choice=\"required\", parallel_tool_calls=False, "
             f"max_tokens {plan['max_tokens']}. {plan.get('tenants', 1)} tenant(s), loop i being tenant i mod "
             f"{plan.get('tenants', 1)}'s (its system prompt, the catalogue and its cache_salt), all loops started "
             f"together; think-time between steps {plan.get('think_s', [0, 0])[0]}-{plan.get('think_s', [0, 0])[1]} s. "
             f"CPU: {res['env']['cpu']['model']} ({res['env']['cpu_count']} cores), "
             f"load average at start {[round(x, 2) for x in res['env']['load_average_1_5_15m']]}. "
             "The machine was shared with other work.", "",
             "Step TTFT is the time to the first streamed delta with content or tool calls. Our app streams a "
             "forced call's first tool_calls delta once the call's name is decoded (its opening tokens are "
             "generated by then); vLLM's first text is its first token. vLLM was given plain prompts: "
             "/v1/completions with the token ids of our chat template's rendering of (b)'s history (catalogue in "
             "the system message, the calls our app made, the same tool results), max_tokens = (b)'s completion "
             "tokens at that step, ignore_eos, greedy, no grammar, no tool parser.", ""]
    lines += step_table(res) + decode_lines(res) + headline_lines(res)
    lines += [f"- Not run: {note}" for note in res["not_run"]]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_hit) = plt.subplots(1, 2, figsize=(13, 5))
    styles = {"a": "o-", "b": "x-", "c": "s--", "d": "^:", "d_on": "v:", "responses": "d-"}
    for s in _ran(res):
        pts = [(t["turn"], t["ttft_p50_s"] * 1e3, t["hit_ratio"]) for t in res["sides"][s]["per_turn"]
               if t["completed"]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(s, "o-"), label=res["labels"][s])
            hits = [(p[0], p[2]) for p in pts if p[2] is not None]
            if hits:
                ax_hit.plot(*zip(*hits), styles.get(s, "o-"), label=res["labels"][s])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("step TTFT p50 (ms, log scale)")
    ax.set_title(f"{res['plan']['loops']} concurrent agent loops, {res['catalogue']['tokens']:,}-token catalogue",
                 fontsize=10)
    ax_hit.set_xlabel("step")
    ax_hit.set_ylabel("hit ratio (cached / prompt tokens)")
    ax_hit.set_ylim(-0.05, 1.05)
    for a in (ax, ax_hit):
        a.xaxis.get_major_locator().set_params(integer=True)
        a.grid(True, which="both", alpha=0.3)
        if a.get_lines():
            a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
