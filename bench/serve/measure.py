"""Each side of the serving benchmark, measured: our app, vLLM's server, the overhead."""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench import serve as benchmark
from bench.kit.app_servers import VllmServer, start_app
from bench.kit.chat_client import ConversationMode, Script, await_tier_export, run_workload
from bench.kit.environment import cpu_flags, environment_info, load_average
from bench.serve import prefix as serve_prefix
from bench.serve.plan import MODES, Plan, make_scripts, overhead_script
from bench.serve.prefix import OUR_SIDES, Side
from bench.serve.reference import InProcessReference
from bench.serve.summary import headline, summarize


def measure_app(plan: Plan, model_dir: Path, scripts: list[Script], tmp: Path) -> dict:
    reference = InProcessReference(plan, model_dir)  # loaded before the app, so the loads do not overlap
    reference.probe(99)  # warm-up, not recorded
    server, base_url, config = start_app(model_dir, tmp)
    out: dict = {"config": config, "command": server.argv}
    try:
        out["startup_s"] = server.wait_ready(600)
        # A short warm-up: first requests pay for lazy initialisation on each side.
        asyncio.run(run_workload(base_url, [overhead_script(plan, 99)] * 2, ConversationMode.STORED, "warm",
                                 plan.request_timeout_s, plan.mode_budget_s))
        out["overhead"] = overhead(plan, base_url, reference)
        for mode, kind in (("a", ConversationMode.STORED), ("b", ConversationMode.FRESH_SALT)):
            out[mode] = run_mode(base_url, scripts, kind, mode, plan)
        out["prefix"] = {w: {side.value: run_prefix_side(base_url, w, side, plan) for side in OUR_SIDES}
                         for w in serve_prefix.WORKLOADS}
    finally:
        server.stop()
    return out


def overhead(plan: Plan, base_url: str, reference: InProcessReference) -> dict:
    """HTTP and in-process samples alternate, so a change of the machine's load hits both alike;
    each in-process sample waits until the app is idle (the previous turn's head exported)."""
    http: dict[str, list] = {"ttft_s": [], "prompt_tokens": [], "cached_tokens": []}
    local: dict[str, list] = {"ttft_s": [], "prompt_tokens": [], "cached_tokens": []}
    waits: list[float | None] = []
    for k in range(plan.overhead_samples):
        res = asyncio.run(run_workload(base_url, [overhead_script(plan, k)], ConversationMode.STORED, f"oh{k}",
                                       plan.request_timeout_s, plan.mode_budget_s))
        if res.errors:
            raise RuntimeError(f"overhead probe failed: {res.errors}")
        measured = res.records[1]
        for key, value in (("ttft_s", measured.ttft_s), ("prompt_tokens", measured.prompt_tokens),
                           ("cached_tokens", measured.cached_tokens)):
            http[key].append(value)
        # The worker exports the new head after answering; the engine here runs once that is done.
        waits.append(await_tier_export(base_url, measured.conversation_id, "bench", 60))
        for key, value in zip(local, reference.probe(k)):
            local[key].append(value)
    return {"http": http, "in_process": local | {"torch_threads": reference.threads}, "tier_export_wait_s": waits}


def run_prefix_side(base_url: str, workload: str, side: Side, plan: Plan) -> dict:
    load = load_average()
    rec = serve_prefix.run_side(base_url, workload, side, plan.prefix, plan.seed, plan.request_timeout_s,
                                plan.mode_budget_s, summarize)
    return rec | {"load_average_before": load, "load_average_after": load_average()}


def run_mode(base_url: str, scripts: list[Script], kind: ConversationMode, tag: str, plan: Plan) -> dict:
    load = load_average()
    res = asyncio.run(run_workload(base_url, scripts, kind, tag, plan.request_timeout_s, plan.mode_budget_s))
    return summarize(res) | {"load_average_before": load, "load_average_after": load_average()}


# -- (c) and (d): vLLM ------------------------------------------------------------------------------
def measure_vllm(plan: Plan, model_dir: Path, scripts: list[Script], tmp: Path) -> tuple[dict, dict]:
    """(c) and (d), then each prefix workload on the same server: ({mode: record}, {workload: {side: record}})."""
    from workers.vllm_backend.venv import ensure_vllm_python

    python = ensure_vllm_python()
    out: dict = {}
    prefix: dict = {w: {} for w in serve_prefix.WORKLOADS}
    for mode, side, extra in (("c", Side.VLLM_ON, []), ("d", Side.VLLM_OFF, ["--no-enable-prefix-caching"])):
        server = VllmServer(python, model_dir, tmp, mode, extra)
        try:
            out[mode] = server.run(lambda url: run_mode(url, scripts, ConversationMode.STATELESS, mode, plan))
            for w in serve_prefix.WORKLOADS:
                if plan.restart_dead_vllm and "startup_error" not in out[mode]:
                    server.restart_if_dead()
                prefix[w][side.value] = server.run(lambda url: run_prefix_side(url, w, side, plan))
        finally:
            server.stop()
    return out, prefix


def run(plan: Plan, quick: bool, skip_vllm: bool, skip_app: bool, vllm_results: Path | None,
        model: Path | None = None) -> dict:
    """`model`: a checkpoint to serve instead of the plan's random preset (its tokenizer may not be
    one token per character: the plan's lengths are then characters)."""
    from workers.checkpoint import make_model

    env = environment_info() | {"cpu": cpu_flags()}
    res: dict = {"quick": quick, "plan": asdict(plan), "model": str(model) if model else None, "env": env,
                 "modes": {}, "overhead": {}, "not_run": [],
                 "prefix": {w: {} for w in serve_prefix.WORKLOADS}, "labels": MODES,
                 "method": benchmark.__doc__ + "\n" + serve_prefix.__doc__}
    scripts = make_scripts(plan)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = model or make_model(tmp / f"granitemoehybrid-{plan.preset}", "granitemoehybrid", plan.preset,
                                        seed=0)
        # Our app first: its numbers are the point; vLLM's engine may hang or die.
        if skip_app:
            res["not_run"].append("(a), (b), overhead: --skip-app")
        else:
            app = measure_app(plan, model_dir, scripts, tmp)
            res["overhead"] = app.pop("overhead")
            res["modes"] |= {m: app.pop(m) for m in ("a", "b")}
            for w, sides in app.pop("prefix").items():
                res["prefix"][w] |= sides
            res["app"] = app
        if vllm_results is not None:
            earlier = json.loads(vllm_results.read_text())
            if earlier["plan"] != json.loads(json.dumps(res["plan"])) or earlier.get("model") != res["model"]:
                raise SystemExit(f"{vllm_results} measured another plan")
            res["modes"] |= {m: earlier["modes"][m] for m in ("c", "d") if m in earlier["modes"]}
            for w, sides in earlier.get("prefix", {}).items():
                res["prefix"][w] |= {s: r for s, r in sides.items() if s in (Side.VLLM_ON.value, Side.VLLM_OFF.value)}
            res["vllm_from"] = {"path": str(vllm_results), "env": earlier["env"], "notes": earlier.get("notes", [])}
            res["not_run"].append(f"(c), (d) this time: taken from {vllm_results.name} of "
                                  f"{earlier['env']['timestamp_utc']} (same plan and checkpoint)")
        elif skip_vllm:
            res["not_run"].append("(c), (d): --skip-vllm")
        else:
            modes, prefix = measure_vllm(plan, model_dir, scripts, tmp)
            res["modes"] |= modes
            for w, sides in prefix.items():
                res["prefix"][w] |= sides
    res["env"]["load_average_end"] = load_average()
    res["headline"] = headline(res)
    res["prefix_headline"] = serve_prefix.headline(res["prefix"])
    return res
