"""Markdown and plot of `bench.scale` results (from the JSON alone)."""

from __future__ import annotations

from pathlib import Path

from bench.kit.tables import format_number as num, markdown_table


def _ms(entry: dict, key: str) -> str:
    return num(entry[key], 2) if entry[key] is not None else "-"


def _key(p: dict) -> tuple:
    pt = p["point"]
    return pt["replicas"], pt["conversations"], pt["instances"]


def _p50_p99(entry: dict) -> str:
    return f"{_ms(entry, 'p50_ms')} / {_ms(entry, 'p99_ms')}"


def compared(res: dict, before: dict) -> list[str]:
    """The points of `before` (an earlier run's JSON) beside this run's, one row each."""
    old = {_key(p): p for p in before["points"]}
    rows = []
    for p in res["points"]:
        b = old.get(_key(p))
        if b is None:
            continue
        for label, q in (("before", b), ("after", p)):
            rows.append([f"{q['point']['replicas']:,} / {q['point']['conversations']:,} / {q['point']['instances']}",
                         label, num(q["turns_per_s_per_instance"], 0),
                         _p50_p99(q["latency"]["acquire"]), _p50_p99(q["latency"]["publish"]),
                         num(q["route"]["mean_ms"], 2), num(q["redis"]["commands_per_turn"], 1),
                         sum((q["errors"] or {}).values()),
                         " ".join(f"{k} {v:.2f}" for k, v in q["cpu_cores"].items())])
    env = before["env"]
    return [f"Before: commit {env['git']['commit'][:12]}, load average {env['load_before'][0]:.1f} / "
            f"{env['load_after'][0]:.1f} ({before['mode']} run, the same plan).", "",
            markdown_table(["replicas / conversations / instances", "run", "turns/s per instance",
                            "acquire p50/p99 ms", "publish p50/p99 ms", "route ms", "Redis cmds/turn",
                            "errors", "CPU cores used"], rows), ""]


def markdown(res: dict, before: dict | None = None) -> str:
    s, env = res["sizing"], res["env"]
    lines = [
        "# Scale simulation: the router's code, real cache-service instances and Redis, simulated replicas", "",
        f"{res['mode']} run on {env['cpu_model']} ({env['cpu_count']} cores, shared machine; load average "
        f"{env['load_before'][0]:.1f} before / {env['load_after'][0]:.1f} after), commit {env['git']['commit']}.",
        f"Warm-up {res['plan']['warmup_s']:g} s, then {res['plan']['measure_s']:g} s measured per point; "
        f"sessions = min(replicas x {res['batch']}, {res['plan']['max_sessions']}); exported head "
        f"{res['plan']['state_bytes'] >> 10} KiB. Redis: embedded, AOF appendfsync everysec.", "",
        "Replica cost model (bench/scale/cost_model.py): " + res["cost_model"]["fit"] + f" Source: {res['cost_model']['source']}.",
        "Mix (bench/scale/mix.py): " + res["mix"], "",
        "## Points", "",
    ]
    rows = []
    for p in res["points"]:
        pt, lat, r = p["point"], p["latency"], p["redis"]
        rows.append([pt["replicas"], f"{pt['conversations']:,}", pt["instances"], p["sessions"],
                     num(p["offered_turns_per_s"], 0), num(p["turns_per_s"], 0), num(p["turns_per_s_per_instance"], 0),
                     f"{_ms(lat['acquire'], 'p50_ms')} / {_ms(lat['acquire'], 'p99_ms')}",
                     f"{_ms(lat['publish'], 'p50_ms')} / {_ms(lat['publish'], 'p99_ms')}",
                     f"{_ms(lat['renew'], 'p50_ms')} / {_ms(lat['renew'], 'p99_ms')} ({lat['renew']['count']})",
                     num(p["route"]["mean_ms"], 2), num(r["commands_per_turn"], 1), num(r["evalsha_per_turn"], 2),
                     num(r["bytes_in_per_turn"] + r["bytes_out_per_turn"], 0), num(p["tier"]["MBps"], 1),
                     " ".join(f"{k} {v:.2f}" for k, v in p["cpu_cores"].items())])
    lines += [markdown_table(["replicas", "conversations", "instances", "sessions", "offered turns/s", "turns/s",
                              "turns/s per instance", "acquire p50/p99 ms", "publish p50/p99 ms",
                              "renew p50/p99 ms (n)", "route ms", "Redis cmds/turn", "EVALSHA/turn",
                              "Redis bytes/turn", "tier MB/s", "CPU cores used"], rows), ""]
    lines += ["Offered = what the replicas would complete with every slot busy (the mix's rate per replica times "
              "replicas, bounded by the sessions). Redis commands count the scripts' inner calls "
              "(INFO commandstats); bytes are Redis's network in + out. Every point's completed turns equal "
              "the turns in the touched conversations' ledgers:", "",
              markdown_table(["replicas", "conversations", "instances", "turns completed", "turns in ledgers",
                              "errors", "seed conv/s", "Redis bytes/conversation"],
                             [[p["point"]["replicas"], f"{p['point']['conversations']:,}", p["point"]["instances"],
                               p["turns_completed_all"], p["turns_in_ledgers"], p["errors"] or "none",
                               num(p["seed"]["per_s"], 0), num(p["seed"]["redis_bytes_per_conversation"], 0)]
                              for p in res["points"]]), ""]
    if before is not None:
        lines += ["## Before and after", ""] + compared(res, before)
    lines += ["## Where it stopped", "", res["stopped"], "",
              "## Saturation", "", res["saturation"], "",
              "## What 1,000 GPU replicas need", "",
              f"Assumed rate: {num(s['gpu_turns_per_s_per_replica'], 1)} turns/s per replica (bench/results/gpu.md, "
              f"ours at c=32 on an H200: 32 turns of 512 + 64 tokens per 2.087 s; this mix's longer replies give "
              f"{num(s['mix_turns_per_s_per_replica'], 1)}): {num(s['demand_turns_per_s'], 0)} turns/s.", "",
              markdown_table(["what", "capacity measured here", "needed for 1,000 replicas"], [
                  ["cache-service instances", f"{num(s['turns_per_instance_core_s'], 0)} turns per instance-core-second",
                   s["instances_needed"]],
                  ["Redis shards", f"{num(s['redis_commands_per_core_s'], 0)} commands per Redis-core-second, "
                   f"{num(s['redis_commands_per_turn'], 1)} per turn", s["redis_shards_needed"]],
                  ["router (ingress) cores", f"{num(s['route_ms_at_widest'], 2)} ms per routing decision over "
                   f"{s['widest_replicas']} replicas", num(s["router_cores_needed"], 0)],
              ]), ""]
    return "\n".join(lines)


def plot(res: dict, path: Path, before: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    instance_counts = sorted({p["point"]["instances"] for p in res["points"]})
    smallest = min(p["point"]["conversations"] for p in res["points"])
    for n in instance_counts:
        pts = sorted((p for p in res["points"] if p["point"]["instances"] == n and p["point"]["conversations"] == smallest),
                     key=lambda p: p["point"]["replicas"])
        xs = [p["point"]["replicas"] for p in pts]
        left.plot(xs, [p["turns_per_s"] for p in pts], "o-", label=f"achieved, {n} instance(s)")
        right.plot(xs, [p["latency"]["publish"]["p99_ms"] for p in pts], "o-", label=f"publish p99, {n} inst.")
        right.plot(xs, [p["latency"]["acquire"]["p99_ms"] for p in pts], "s--", label=f"acquire p99, {n} inst.")
        if n == instance_counts[0]:
            left.plot(xs, [p["offered_turns_per_s"] for p in pts], "k:", label="offered (replicas' full rate)")
        if before is not None:
            old = sorted((p for p in before["points"] if p["point"]["instances"] == n
                          and p["point"]["conversations"] == smallest), key=lambda p: p["point"]["replicas"])
            left.plot([p["point"]["replicas"] for p in old], [p["turns_per_s"] for p in old], "x--", alpha=0.5,
                      label=f"before, {n} instance(s)")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("simulated replicas")
        ax.legend(fontsize=8)
    left.set_ylabel("turns/s (0: none completed in the window)")
    right.set_yscale("log")
    left.set_title(f"turns/s ({smallest:,} conversations)")
    right.set_ylabel("ms")
    right.set_title("cache-service call latency p99")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
