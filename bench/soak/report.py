"""The soak's bound, its checks, its Markdown and its plot, all from the run's JSON.

The bound, derived from the run itself:

    conversations alive at t   N(t) = conversations whose last turn ended within (t - W, t],
                                      W = TTL + lease TTL + 2 s (a fence outlives its last lease by the TTL;
                                      Redis reclaims expired keys within about a second)
    bytes per conversation     b    = (used_memory - baseline) / conversations stored, over the first TTL
                                      window (nothing has expired yet): everything one stored call costs
                                      Redis, its prefix-index entries and hash-table share included
    keys per conversation      k    = the same, of DBSIZE
    live ledgers               L    = the most the live conversations' own keys held at once (measured after
                                      each of their turns: they grow by a turn each, up to live_turns_each);
                                      twice that, since the one a live chat moved on from lives a window more
                                      (counted in N too, at b: its ledger is longer)
    bound                      baseline + MARGIN x (b x (max N + live) + 2L)
                               keys: baseline + MARGIN x k x (max N + live)

MARGIN = 1.25 covers what is not linear in the count (Redis hash tables grow by doubling, the
allocator's size classes). Without retention, memory would instead reach baseline + b x every
conversation stored: the table shows that figure beside the bound.
"""

from __future__ import annotations

from pathlib import Path

from bench.kit.tables import markdown_table

MARGIN = 1.25
EXPIRY_LAG_S = 2.0


def window_s(plan: dict) -> float:
    return plan["ttl_s"] + plan["lease_ttl_s"] + EXPIRY_LAG_S


def _alive(last_use: list[float], t: float, window: float) -> int:
    return sum(1 for u in last_use if t - window < u <= t)


def analyze(result: dict) -> dict:
    """The bound and the checks; stored in the JSON (`report`) so the Markdown renders from it."""
    plan, seen = result["plan"], result["observed"]
    samples, uses = seen["samples"], sorted(seen["last_use"].values())
    window, live = window_s(plan), plan["live"]
    before = [s for s in samples if s["t"] <= 0]
    base = before[-1] if before else samples[0]
    # The first window: from the load's start until the first stored conversation could expire.
    first_expiry = (uses[0] if uses else 0.0) + plan["ttl_s"]
    ramp = [s for s in samples if 0 < s["t"] < first_expiry]
    end_ramp = ramp[-1] if ramp else samples[-1]
    stored = _alive(uses, end_ramp["t"], float("inf")) + live
    per_conv_bytes = (end_ramp["used_memory"] - base["used_memory"]) / max(stored, 1)
    per_conv_keys = (end_ramp["keys"] - base["keys"]) / max(stored, 1)
    max_alive = max((_alive(uses, s["t"], window) for s in samples), default=0) + live
    memory_bound = base["used_memory"] + MARGIN * (per_conv_bytes * max_alive + 2 * seen.get("live_bytes_max", 0))
    keys_bound = base["keys"] + MARGIN * per_conv_keys * max_alive
    steady = [s for s in samples if s["t"] >= first_expiry]
    peak_memory = max(s["used_memory"] for s in samples)
    peak_keys = max(s["keys"] for s in samples)
    final = samples[-1]
    live_turns = seen["live_turns"]
    continued = [t for t in live_turns if t["turn"] == t["expected"]]
    live_expected = {}
    for t in live_turns:
        live_expected[t["conversation"]] = max(live_expected.get(t["conversation"], 0), t["turn"])
    checks = {
        "no errors": not seen["errors"],
        "used_memory under the bound after the first TTL window": all(s["used_memory"] <= memory_bound for s in steady),
        "keys under the bound after the first TTL window": all(s["keys"] <= keys_bound for s in steady),
        # (and at most one each that a live chat moved on from within the last window)
        "a TTL after the load: keys back to the baseline + the live conversations'":
            final["keys"] <= base["keys"] + max(per_conv_keys, 1) * MARGIN * 2 * live + 2,
        "every live turn continued its conversation's ledger": len(continued) == len(live_turns) > 0,
        # (the conversations each live chat moved on to last: the earlier ones were left to expire)
        "every live conversation holds all its turns at the end": bool(seen["live_ledgers"]) and seen[
            "live_ledgers"] == {c: n for c, n in live_expected.items() if c in seen["live_ledgers"]},
    }
    return {
        "window_s": window,
        "baseline": {"used_memory": base["used_memory"], "keys": base["keys"]},
        "stored_conversations": len(uses) + live,
        "bytes_per_conversation": round(per_conv_bytes),
        "keys_per_conversation": round(per_conv_keys, 2),
        "conversation_keys_bytes_measured": _spread(seen["conversation_bytes"]),
        "max_alive_in_window": max_alive,
        "memory_bound": round(memory_bound),
        "keys_bound": round(keys_bound),
        "without_retention_memory": round(base["used_memory"] + per_conv_bytes * (len(uses) + live)),
        "without_retention_keys": round(base["keys"] + per_conv_keys * (len(uses) + live)),
        "peak_used_memory": peak_memory,
        "peak_steady_used_memory": max((s["used_memory"] for s in steady), default=None),
        "peak_keys": peak_keys,
        "peak_steady_keys": max((s["keys"] for s in steady), default=None),
        "final": {"used_memory": final["used_memory"], "keys": final["keys"], "t": final["t"]},
        "live_turns": len(live_turns),
        "live_cached_fraction": round(sum(t["cached_tokens"] > 0 for t in live_turns) / max(len(live_turns), 1), 3),
        "calls_per_s": round((plan["responses"] + 2 * plan["conversations"]) / max(seen["load_end_s"], 1e-9), 1),
        "checks": checks,
    }


def _spread(values: list[int]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(values), "min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def _mib(n: float | None) -> str:
    return "—" if n is None else f"{n / (1 << 20):.2f} MiB"


def markdown(result: dict) -> str:
    plan, report, seen = result["plan"], result["report"], result["observed"]
    model = "the built-in model" if plan["builtin_model"] else "the tiny test checkpoint"
    rows = [
        ["stateless Responses calls (each stores a conversation)", plan["responses"]],
        ["two-turn conversations", plan["conversations"]],
        ["live conversations (a turn every TTL / 4)", f"{plan['live']}, {report['live_turns']} turns"],
        ["conversation TTL (run) / window W", f"{plan['ttl_s']:g} s / {report['window_s']:g} s"],
        ["load", f"{seen['load_end_s']:.0f} s, {report['calls_per_s']} calls/s, {plan['concurrency']} clients"],
        ["baseline", f"{_mib(report['baseline']['used_memory'])}, {report['baseline']['keys']} keys"],
        ["bytes / keys per stored conversation (first window)",
         f"{report['bytes_per_conversation']} B / {report['keys_per_conversation']}"],
        ["its own keys (MEMORY USAGE of head + ledger + marks + fence)",
         ", ".join(f"{k} {v}" for k, v in report["conversation_keys_bytes_measured"].items())],
        ["most conversations alive within W (+ live)", report["max_alive_in_window"]],
        ["**bound**: used_memory / keys", f"**{_mib(report['memory_bound'])} / {report['keys_bound']}**"],
        ["peak after the first window: used_memory / keys",
         f"{_mib(report['peak_steady_used_memory'])} / {report['peak_steady_keys']}"],
        ["peak of the run: used_memory / keys", f"{_mib(report['peak_used_memory'])} / {report['peak_keys']}"],
        ["a TTL after the load: used_memory / keys",
         f"{_mib(report['final']['used_memory'])} / {report['final']['keys']}"],
        ["without retention it would be",
         f"{_mib(report['without_retention_memory'])} / {report['without_retention_keys']}"],
        ["live turns served from a cached head or prefix", f"{100 * report['live_cached_fraction']:.0f} %"],
    ]
    checks = [[name, "pass" if ok else "**FAIL**"] for name, ok in report["checks"].items()]
    lines = [f"# Retention soak ({model}, TTL {plan['ttl_s']:g} s)", "",
             "Redis `used_memory` and key count (DBSIZE) while the real app stores every call; the bound is "
             "derived in `bench/soak/report.py`. Plot: `soak*.png`.", "",
             markdown_table(["", "value"], rows, "lr"), "", markdown_table(["check", ""], checks, "ll"), ""]
    if seen["errors"]:
        lines += [f"Errors: {seen['errors']}", ""]
    lines += [f"CPU: {result['environment'].get('cpu')}"]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report, samples = result["report"], result["observed"]["samples"]
    t = [s["t"] for s in samples]
    fig, (mem, keys) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    mem.plot(t, [s["used_memory"] / (1 << 20) for s in samples], label="used_memory")
    mem.axhline(report["memory_bound"] / (1 << 20), color="red", linestyle="--", label="bound")
    mem.set_ylabel("MiB")
    keys.plot(t, [s["keys"] for s in samples], label="keys (DBSIZE)", color="green")
    keys.axhline(report["keys_bound"], color="red", linestyle="--", label="bound")
    keys.set_ylabel("keys")
    keys.set_xlabel("seconds since the load started")
    for ax in (mem, keys):
        ax.axvline(result["observed"]["load_end_s"], color="gray", linestyle=":", label="load ends")
        ax.legend(loc="upper left")
        ax.grid(alpha=0.3)
    mem.set_title(f"Redis under stored traffic, conversation TTL {result['plan']['ttl_s']:g} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
