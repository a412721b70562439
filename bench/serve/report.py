"""The serving benchmark's Markdown and plot, from its JSON alone."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.kit.tables import format_number, markdown_table, ms
from bench.serve import prefix as serve_prefix
from bench.serve.plan import MODES


def mode_tables(modes: dict, labels: dict[str, str]) -> list[str]:
    """The TTFT per turn and the summary of each mode, and what failed (Markdown lines)."""
    lines = []
    present = [m for m in labels if m in modes and "per_turn" in modes[m]]
    turns = max((len(modes[m]["per_turn"]) for m in present), default=0)
    rows = []
    for i in range(turns):
        row = [str(i + 1)]
        for m in present:
            pt = modes[m]["per_turn"][i] if i < len(modes[m]["per_turn"]) else None
            row.append("—" if not pt or not pt["completed"] else
                       f"{ms(pt['ttft_p50_s'])} / {ms(pt['ttft_p99_s'])} ({format_number(pt['prompt_tokens_mean'], 0)} tok)")
        rows.append(row)
    if present:
        lines += ["TTFT p50 / p99 in ms per turn (mean prompt tokens):", "",
                  markdown_table(["turn", *[labels[m] for m in present]], rows)]
        summary = [[labels[m], f"{modes[m]['turns_completed']}", format_number(modes[m]["output_tokens_per_s"]),
                    "—" if modes[m]["cache_hit_ratio"] is None else f"{modes[m]['cache_hit_ratio']:.1%}",
                    f"{modes[m]['wall_s']:.1f}", str(len(modes[m]["errors"]))] for m in present]
        lines += [markdown_table(["mode", "turns done", "output tok/s", "cache hit ratio", "wall s", "errors"], summary)]
    for m, rec in modes.items():
        if rec.get("errors"):
            lines.append(f"- {labels[m]}: {len(rec['errors'])} failed turns; first: `{rec['errors'][0][:300]}`")
        if rec.get("startup_error"):
            lines.append(f"- {labels[m]}: did not start: `{rec['startup_error'][-300:]}`")
    lines.append("")
    return lines


def last_turn_table(lt: dict, labels: dict[str, str], ref: str = "a") -> str:
    """last_turn()'s record as a table: each mode's TTFT p50 over `ref`'s, or how far it got."""
    rows = [[labels[ref], ms(lt[f"{ref}_ttft_p50_s"]), "1.0x"]]
    for m, r in lt["modes"].items():
        if "ratio" in r:
            rows.append([labels[m], ms(r["ttft_p50_s"]), f"{r['ratio']:.1f}x"])
        else:
            rows.append([labels[m], f"— (reached turn {r['reached_turn']}"
                         + (f", {format_number(r['reached_prompt_tokens'], 0)} tok" if r["reached_turn"] else "")
                         + f"; {r['stopped_because'][:120]})", "—"])
    return markdown_table(["mode", "TTFT p50 ms", f"over ({ref})"], rows)


def checkpoint_words(res: dict) -> str:
    if res.get("model"):
        return f"checkpoint `{res['model']}`"
    return f"GraniteMoeHybrid `{res['plan'].get('preset', 'bench')}` checkpoint"


def markdown(res: dict) -> str:
    modes, h = res["modes"], res["headline"]
    lines = [f"# Serving benchmark{' (quick)' if res['quick'] else ''}", "",
             f"{res['plan']['conversations']} concurrent conversations x {res['plan']['turns']} turns, "
             f"{checkpoint_words(res)}, greedy, streamed over HTTP with `openai`. "
             f"CPU: {res['env']['cpu']['model']} ({res['env']['cpu_count']} cores), load average at start "
             f"{res['env']['load_average_1_5_15m']}. The machine was shared with other work.", ""]
    lines += mode_tables(modes, MODES)
    if h.get("last_turn"):
        lt = h["last_turn"]
        lines += [f"At the last turn ({lt['turn']}, {format_number(lt['prompt_tokens'], 0)} prompt tokens; "
                  f"target >= 5x at >= 2k tokens):", "", last_turn_table(lt, MODES), ""]
    for m, r in h["ttft_p50_ratio_over_a"].items():
        lines.append(f"- {MODES[m]} over (a) at turn {r['turn']} ({format_number(r['prompt_tokens'], 0)} prompt "
                     f"tokens), the last both completed: TTFT p50 {ms(r['other_ttft_p50_s'])} ms / "
                     f"{ms(r['a_ttft_p50_s'])} ms = {r['ratio']:.1f}x (target >= 5x at a >= 2k-token history).")
    if "overhead_ratio" in h:
        oh = res["overhead"]
        lines.append(f"Serving overhead at a {h['overhead_history_tokens']:.0f}-token history "
                     f"({h['overhead_prompt_tokens']:.0f}-token prompt): HTTP TTFT "
                     f"{ms(statistics.median(t for t in oh['http']['ttft_s'] if t is not None))} ms / in-process "
                     f"{ms(statistics.median(oh['in_process']['ttft_s']))} ms = {h['overhead_ratio']:.2f}x "
                     f"(medians of {len(oh['http']['ttft_s'])} alternating samples; of the minima "
                     f"{h['overhead_ratio_of_minima']:.2f}x; target <= 1.3x).")
    if "overhead_unmeasured" in h:
        lines.append(f"Serving overhead: not measured ({h['overhead_unmeasured']}).")
    lines += ["", *serve_prefix.markdown(res["prefix"], res["plan"]["prefix"], res["prefix_headline"])]
    for note in res["not_run"]:
        lines.append(f"- Not run: {note}")
    for note in res.get("notes", []):
        lines.append(f"- Note: {note}")
    return "\n".join(lines) + "\n"


def plot_ttft(ax, modes: dict, labels: dict[str, str], styles: dict[str, str], title: str) -> None:
    """TTFT p50 per completed turn of each mode in `styles`, log scale."""
    for m, style in styles.items():
        rec = modes.get(m)
        if not rec or "per_turn" not in rec:
            continue
        pts = [(t["turn"], t["ttft_p50_s"] * 1e3) for t in rec["per_turn"] if t["completed"]]
        if pts:
            ax.plot(*zip(*pts), style, label=labels[m])
    ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms, log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=7)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_turns, ax_shared) = plt.subplots(1, 3, figsize=(18, 5.5))
    plot_ttft(ax, res["modes"], MODES, {"a": "o-", "b": "x-", "c": "s:", "d": "^--"},
              f"TTFT per turn over HTTP — {res['plan']['conversations']} concurrent conversations")
    serve_prefix.plot(ax_turns, ax_shared, res["prefix"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
