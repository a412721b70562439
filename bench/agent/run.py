"""The agent benchmark's plans and sides: tool-calling loops on our app and on vLLM's server."""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench import agent as benchmark
from bench.agent import decode as agent_decode
from bench.agent.workload import (
    AgentLoop,
    LoopScript,
    PromptRenderer,
    Side,
    make_loop_scripts,
    run_loops,
    sized_catalogue,
)
from bench.kit.app_servers import VllmServer, start_app
from bench.kit.environment import environment_info, load_average
from bench.serve.summary import summarize
from workers.vllm_backend.venv import VENV_DIR, vllm_python


@dataclass(frozen=True)
class Plan:
    loops: int
    steps: int
    catalogue_tokens: int  # target; the measured count is recorded
    result_tokens: tuple[int, int]
    max_tokens: int  # of a step's reply (a forced call ends well before)
    decode_rounds: int
    decode_max_tokens: int
    request_timeout_s: float
    side_budget_s: float  # wall-time budget of one side's loops; steps not done by then are cut off
    vllm_prefix_on: bool = True  # also run vLLM with prefix caching on (d_on)
    seed: int = 0
    preset: str = "bench"
    tenants: int = 2  # loop i is tenant i % tenants's: one system prompt, catalogue and cache_salt each
    think_s: tuple[float, float] = (0.0, 0.0)  # an agent's pause between a tool's result and its next step
    # The app's cache budgets per worker (MiB) where config.yaml's do not hold the plan's working set.
    cache_mb: dict[str, int] = field(default_factory=dict)


# Shaped like a deployment: 2 tenants of 4 loops each, started together, 10 steps, tool results
# of 200-2,000 tokens, and the agent's think-time between steps.
# Its histories reach 10-14k tokens, 40-56 MiB of heads each at this checkpoint's 4 KiB of KV a token
# (4 attention layers, 2 KV heads of 64, float32): config.yaml's 128 MiB of heads per worker holds
# fewer than three of a worker's four loops, and a head dropped before its write-behind export is
# recomputed from the ledger at the next step. Sized as a deployment sizes them for its sessions
# (vLLM's server is given 30% of the machine's memory for its KV cache).
FULL = Plan(loops=8, steps=10, catalogue_tokens=2000, result_tokens=(200, 2000), max_tokens=160, decode_rounds=4,
            decode_max_tokens=40, request_timeout_s=900, side_budget_s=2400, think_s=(0.5, 2.0),
            cache_mb={"kv_cache_mb": 1024, "head_cache_mb": 512, "prefix_cache_mb": 512})


QUICK = Plan(loops=8, steps=4, catalogue_tokens=2000, result_tokens=(200, 500), max_tokens=160, decode_rounds=2,
             decode_max_tokens=40, request_timeout_s=600, side_budget_s=900, think_s=(0.2, 1.0))


# Proves the benchmark runs (CI, tests/bench): the tiny checkpoint, a small catalogue; measures nothing.
SMOKE = Plan(loops=2, steps=3, catalogue_tokens=300, result_tokens=(20, 50), max_tokens=160, decode_rounds=1,
             decode_max_tokens=24, request_timeout_s=300, side_budget_s=600, vllm_prefix_on=False, preset="tiny",
             tenants=1)


SIDES = {
    Side.EXPLICIT: "(a) ours, conversation_id (only the new tool message; the tenant's cache_salt)",
    Side.STATELESS: "(b) ours, stateless full history (the tenant's cache_salt)",
    Side.RECOMPUTE: "(c) ours, reuse off (a fresh cache_salt per request)",
    Side.VLLM_OFF: "(d) vLLM-CPU, --no-enable-prefix-caching, same prompts as token ids",
    Side.VLLM_ON: "(d_on) vLLM-CPU, prefix caching on, same prompts as token ids",
    Side.RESPONSES: "(responses) ours, Responses API with previous_response_id",
}


# Run in this order on one app. A stateless step ending in a tool call leaves its end as a
# checkpoint that for the engine's tool_pause_s (300 s) no mark may evict within its
# tool_pause_share (half) of the checkpoint budget: (c)'s 32 ends, each under a salt nobody
# sends again, would hold that half of a replica's budget for that long (with no share, they
# filled it, and the Responses side run after them once shared 0 of 8 first steps). (c) runs
# last; the sides whose first steps share the tenant's prefix run first, the ones whose ends are
# conversation heads (outside that budget) before (b).
OUR_SIDES = (Side.EXPLICIT, Side.RESPONSES, Side.STATELESS, Side.RECOMPUTE)


@dataclass(frozen=True)
class Workload:
    tools: list[dict]
    scripts: list[LoopScript]
    renderer: PromptRenderer


def run_side(base_url: str, work: Workload, side: Side, plan: Plan, replay: dict | None = None) -> dict:
    run_tag = uuid.uuid4().hex[:8]  # salts of this side's run alone: no side reuses another's state
    loops = [AgentLoop(i, s, side, work.tools, side.value, run_tag, replay, work.renderer)
             for i, s in enumerate(work.scripts)]
    load = load_average()
    ours = side in OUR_SIDES
    before = route_decisions(base_url) if ours else {}
    res = asyncio.run(run_loops(base_url, loops, plan.steps, plan.request_timeout_s, plan.side_budget_s))
    out = summarize(res) | {"load_average_before": load, "load_average_after": load_average()}
    if ours:  # why each of the side's requests went where it went (the router's counter, this side's share)
        after = route_decisions(base_url)
        out["route_decisions"] = {r: after[r] - before.get(r, 0) for r in after
                                  if r != PREFIX_IMPORTS and after[r] - before.get(r, 0)}
        out["tier_imports"] = after.get(PREFIX_IMPORTS, 0) - before.get(PREFIX_IMPORTS, 0)
    return out


# Stateless requests whose prefix a replica imported from the state tier (a "reason" of its own here).
PREFIX_IMPORTS = "~prefix_imports"


def route_decisions(base_url: str) -> dict[str, int]:
    """`hybridserve_route_decisions_total` by reason, and the prefix imports from the tier
    (`hybridserve_prefix_imports_total`, as PREFIX_IMPORTS), read from the app's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if family.name == "hybridserve_route_decisions":
                out[sample.labels["reason"]] = int(sample.value)
            elif family.name == "hybridserve_prefix_imports":
                out[PREFIX_IMPORTS] = int(sample.value)
    return out


def measure_app(plan: Plan, model_dir: Path, work: Workload, tmp: Path, loops: bool = True) -> dict:
    server, base_url, config = start_app(model_dir, tmp, args=plan.cache_mb)
    out: dict = {"config": config, "command": server.argv, "sides": {}}
    try:
        out["startup_s"] = server.wait_ready(600)
        warm = Workload(work.tools, work.scripts[:1], work.renderer)  # lazy initialisation, grammar compiles
        out["warm_up"] = run_side(base_url, warm, Side.STATELESS, Plan(**asdict(plan) | {"steps": 2}))["errors"]
        for side in OUR_SIDES if loops else ():
            out["sides"][side.value] = run_side(base_url, work, side, plan)
        out["decode"] = agent_decode.measure(base_url, work.scripts, work.tools, plan.decode_rounds,
                                             plan.decode_max_tokens, plan.request_timeout_s)
    finally:
        server.stop()
    return out


def replay_of(side: dict) -> dict[tuple[int, int], dict]:
    """(loop, step) -> our app's call and reply length there: what vLLM is given."""
    return {(r["conversation"], r["turn"]): {"calls": r["calls"], "completion_tokens": r["completion_tokens"]}
            for r in side["records"] if r["error"] is None and r["calls"]}


def measure_vllm(plan: Plan, model_dir: Path, work: Workload, replay: dict, tmp: Path) -> dict:
    out = {}
    runs = [(Side.VLLM_OFF, ["--no-enable-prefix-caching"])] + ([(Side.VLLM_ON, [])] if plan.vllm_prefix_on else [])
    for side, extra in runs:
        server = VllmServer(vllm_python(), model_dir, tmp, side.value, [*extra, "--enable-prompt-tokens-details"])
        try:
            out[side.value] = server.run(lambda url: run_side(url, work, side, plan, replay))
        finally:
            server.stop()
    return out


# -- headline ---------------------------------------------------------------------------------------
def _steps(rec: dict | None) -> dict[int, dict]:
    if not rec or "per_turn" not in rec:
        return {}
    return {t["turn"]: t for t in rec["per_turn"] if t["completed"]}


def reuse_by_step(records: list[dict]) -> dict:
    """What issue-level targets read: the hit ratio from step 2 on, and how many loops' first
    step reused something (their tenant's catalogue, computed by a loop that started with them)."""
    done = [r for r in records if r["error"] is None and r["prompt_tokens"] and r["cached_tokens"] is not None]
    later = [r for r in done if r["turn"] >= 2]
    first = [r for r in done if r["turn"] == 1]
    return {"hit_ratio_from_step_2": (sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)
                                      if later else None),
            "step_1_loops": len(first), "step_1_loops_reusing": sum(1 for r in first if r["cached_tokens"] > 0),
            "step_1_cached_tokens": [r["cached_tokens"] for r in sorted(first, key=lambda r: r["conversation"])]}


def headline(res: dict) -> dict:
    """(a)'s TTFT advantage at the last step each side completed; the hit ratios; the grammar's cost."""
    a = _steps(res["sides"].get(Side.EXPLICIT.value))
    out: dict = {"ttft_p50_ratio_over_a": {}, "hit_ratio": {}, "reuse": {},
                 "decode_overhead": agent_decode.headline(res["decode"])}
    for side, rec in res["sides"].items():
        out["hit_ratio"][side] = rec.get("cache_hit_ratio")
        if "records" in rec:
            out["reuse"][side] = reuse_by_step(rec["records"])
        other = _steps(rec)
        common = sorted(a.keys() & other.keys())
        if side != Side.EXPLICIT.value and common:
            s = common[-1]
            out["ttft_p50_ratio_over_a"][side] = {
                "step": s, "prompt_tokens": a[s]["prompt_tokens_mean"], "a_ttft_p50_s": a[s]["ttft_p50_s"],
                "other_ttft_p50_s": other[s]["ttft_p50_s"], "ratio": other[s]["ttft_p50_s"] / a[s]["ttft_p50_s"],
                "last_step_of_plan": s == res["plan"]["steps"]}
    return out


def run(plan: Plan, quick: bool, skip_vllm: bool, decode_only: bool = False) -> dict:
    from workers.checkpoint import make_model

    res: dict = {"quick": quick, "plan": asdict(plan), "env": environment_info(), "sides": {}, "decode": {},
                 "not_run": [], "labels": {s.value: label for s, label in SIDES.items()}, "method": benchmark.__doc__}
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = make_model(tmp / f"granitemoehybrid-{plan.preset}", "granitemoehybrid", plan.preset, seed=0)
        renderer = PromptRenderer(model_dir)
        tools, catalogue_tokens = sized_catalogue(renderer, plan.catalogue_tokens, plan.seed)
        scripts = make_loop_scripts(plan.loops, plan.steps, plan.result_tokens, plan.max_tokens, plan.seed,
                                    plan.tenants, plan.think_s)
        first = [{"role": "system", "content": scripts[0].system}, {"role": "user", "content": scripts[0].task}]
        res["catalogue"] = {"tools": len(tools), "tokens": catalogue_tokens, "tokenizer": "the checkpoint's",
                            "first_step_prompt_tokens": len(renderer.ids(first, tools)), "definitions": tools}
        work = Workload(tools, scripts, renderer)
        app = measure_app(plan, model_dir, work, tmp, loops=not decode_only)
        res["sides"] |= app.pop("sides")
        res["decode"] = app.pop("decode")
        res["app"] = app
        if decode_only:
            res["not_run"].append("(a), (b), (c), (d): --decode-only")
        elif skip_vllm:
            res["not_run"].append("(d): --skip-vllm")
        elif not (VENV_DIR / ".ready").exists():
            res["not_run"].append(f"(d): no vLLM venv at {VENV_DIR} (make it with `python -m workers.vllm_backend.venv`)")
        else:
            replay = replay_of(res["sides"][Side.STATELESS.value])
            res["sides"] |= measure_vllm(plan, model_dir, work, replay, tmp)
    res["env"]["load_average_end"] = load_average()
    res["headline"] = headline(res)
    return res
