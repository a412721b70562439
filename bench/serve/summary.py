"""Per-turn and per-mode figures of a workload's records, and the headline comparisons."""

from __future__ import annotations

import statistics

from bench.kit.chat_client import WorkloadResult
from bench.kit.stats import percentile


def summarize(res: WorkloadResult) -> dict:
    ok = [r for r in res.records if r.error is None and r.ttft_s is not None]
    turns = sorted({r.turn for r in res.records})
    by_turn = {(r.conversation, r.turn): r for r in ok}
    per_turn = []
    for t in turns:
        rows = [r for r in ok if r.turn == t]
        counted = [r for r in rows if r.cached_tokens is not None and r.prompt_tokens]
        # The history a turn resends: the previous turn's prompt and reply (an explicit conversation's
        # head also holds the reply's end-of-message tokens, so its ratio may pass 100%).
        history = [(r.cached_tokens, by_turn[r.conversation, t - 1].prompt_tokens
                    + by_turn[r.conversation, t - 1].completion_tokens)
                   for r in counted if (r.conversation, t - 1) in by_turn]
        per_turn.append({
            "hit_ratio": (sum(r.cached_tokens for r in counted) / sum(r.prompt_tokens for r in counted)
                          if counted else None),
            "history_hit_ratio": sum(c for c, _ in history) / sum(h for _, h in history) if history else None,
            "turn": t,
            "completed": len(rows),
            "ttft_p50_s": percentile([r.ttft_s for r in rows], 50),
            "ttft_p99_s": percentile([r.ttft_s for r in rows], 99),
            "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in rows) if rows else None,
            "cached_tokens_mean": (statistics.fmean(r.cached_tokens for r in rows)
                                   if rows and all(r.cached_tokens is not None for r in rows) else None),
        })
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    completion = sum(r.completion_tokens or 0 for r in ok)
    return {
        "per_turn": per_turn,
        "turns_completed": len(ok),
        "output_tokens": completion,
        "output_tokens_per_s": completion / res.wall_s if res.wall_s else None,
        "cache_hit_ratio": (sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)
                            if reported and prompt else None),
        "cached_tokens_reported": bool(reported),
    } | res.as_dict()


def completed_turns(mode: dict | None) -> dict[int, dict]:
    if not mode or "per_turn" not in mode:
        return {}
    return {t["turn"]: t for t in mode["per_turn"] if t["completed"]}


def first_failure(mode: dict) -> str:
    if mode.get("startup_error"):
        return f"did not start: {mode['startup_error'][-200:]}"
    died = " (the server no longer answered /health)" if mode.get("server_alive_after") is False else ""
    return (mode.get("errors") or ["no error recorded"])[0][:200] + died


def last_turn(res: dict, ref: str = "a", others: tuple[str, ...] = ("b", "c", "d")) -> dict | None:
    """Every other mode at `ref`'s last completed turn (the longest history): TTFT p50 and its
    ratio over `ref`'s, or how far the mode got and why it stopped (a server dying mid-run is a
    result)."""
    a = completed_turns(res["modes"].get(ref))
    if not a:
        return None
    t = max(a)
    out: dict = {"turn": t, "prompt_tokens": a[t]["prompt_tokens_mean"], f"{ref}_ttft_p50_s": a[t]["ttft_p50_s"],
                 "modes": {}}
    for m in others:
        mode = res["modes"].get(m)
        if mode is None:
            continue
        done = completed_turns(mode)
        if t in done:
            out["modes"][m] = {"ttft_p50_s": done[t]["ttft_p50_s"], "ratio": done[t]["ttft_p50_s"] / a[t]["ttft_p50_s"]}
        else:
            reached = max(done, default=0)
            out["modes"][m] = {"reached_turn": reached, "stopped_because": first_failure(mode),
                               "reached_prompt_tokens": done[reached]["prompt_tokens_mean"] if reached else None}
    return out


def headline(res: dict) -> dict:
    """(a)'s TTFT advantage at the last turn both modes completed, and the serving overhead."""
    a = completed_turns(res["modes"].get("a"))
    out: dict = {"ttft_p50_ratio_over_a": {}, "last_turn": last_turn(res)}
    for other in ("b", "c", "d"):
        o = completed_turns(res["modes"].get(other))
        common = sorted(a.keys() & o.keys())
        if common:
            t = common[-1]
            out["ttft_p50_ratio_over_a"][other] = {
                "turn": t, "prompt_tokens": a[t]["prompt_tokens_mean"],
                "ratio": o[t]["ttft_p50_s"] / a[t]["ttft_p50_s"],
                "a_ttft_p50_s": a[t]["ttft_p50_s"], "other_ttft_p50_s": o[t]["ttft_p50_s"]}
    oh = res.get("overhead", {})
    # A probe whose reply streamed no text (a greedy reply that ended at once) has no HTTP TTFT.
    pairs = list(zip(oh["http"]["ttft_s"], oh["in_process"]["ttft_s"])) if oh.get("http") and oh.get("in_process") else []
    pairs = [(h, p) for h, p in pairs if h is not None and p is not None]
    if oh and not pairs:
        out["overhead_unmeasured"] = "no overhead probe streamed text over HTTP"
    if pairs:
        http, local = [h for h, _ in pairs], [p for _, p in pairs]
        out["overhead_ratio"] = statistics.median(http) / statistics.median(local)
        out["overhead_ratio_of_minima"] = min(http) / min(local)
        # The history is what the measured turn reused; the prompt adds the new message to it.
        out["overhead_history_tokens"] = statistics.median(oh["in_process"]["cached_tokens"])
        out["overhead_prompt_tokens"] = statistics.median(oh["in_process"]["prompt_tokens"])
    return out
