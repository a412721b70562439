"""`python -m bench.serve --backend vllm [--quick | --smoke]`: bench.serve's multi-turn workload
(N concurrent conversations x T turns, streamed, greedy, over HTTP with `openai`) on our app
with its workers on vLLM's engine, against vLLM's own OpenAI server and our app on our engine.

Per model (the GraniteMoeHybrid `bench` checkpoint, dense, and its mixture-of-experts variant;
random weights, made in a temp dir), one side at a time on an otherwise idle benchmark, each
a server of its own started for it and stopped after it:

  (v) our app on the vLLM backend: `serve run` of config.vllm.yaml (`backend: vllm`; each of the
      2 Worker replicas runs vLLM's LLMEngine in an engine host with 1 thread, and our KV
      connector loads the conversation's committed head, attention KV and Mamba state, before
      each turn and captures it after); each turn sends only the new user message with
      `conversation_id` + `cache_salt`;
  (a) our app on our engine: `serve run` of config.yaml (2 replicas, 1 torch thread each), the
      same requests: bench.serve's (a);
  (d) vLLM's OpenAI server with `--no-enable-prefix-caching`, full history each turn;
  (c) vLLM's OpenAI server with its defaults (prefix caching on), full history each turn: its
      engine died on the first long chat in bench.serve; it runs last, and what it reached
      before a failure or its time budget is recorded.
  vLLM's servers run as bench.serve's (c) and (d): `--dtype float32`, a lowered
  `--gpu-memory-utilization`, all cores for their OpenMP threads.

Before the workload each app answers one-turn conversations until both worker replicas have
served one (the first turn on a replica pays for its lazy start: on the vLLM backend, its
engine host loading vLLM). Each side's workload has bench.serve's wall-time budget; turns not
finished within it are reported as cut off.

Per turn: TTFT p50/p99 over the conversations, prompt and cached tokens (bench.serve's summary).
Targets at the last turn (>= 2k tokens of history): (v)'s TTFT p50 >= 5x lower than vLLM's
server's, and within 1.3x of (a)'s on the dense model.
Writes bench/results/serve.vllm.{json,md,png} (--quick: serve.vllm.quick.*; --smoke, the tiny
checkpoint with 32-wide attention heads, dense only, one short conversation:
serve.vllm.smoke.*; --results-dir elsewhere).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.kit.app_servers import VllmServer, start_app
from bench.kit.chat_client import ConversationMode, Script, run_workload
from bench.kit.environment import environment_info, load_average
from bench.kit.tables import format_number
from bench.serve.measure import run_mode
from bench.serve.plan import MODES, Plan, make_scripts
from bench.serve.report import last_turn_table, mode_tables, plot_ttft
from bench.serve.summary import last_turn

SIDES = {
    "v": "(v) our app on the vLLM backend, conversation cache on",
    "a": "(a) our app on our engine, conversation cache on",
    "d": MODES["d"],
    "c": MODES["c"],
}
STYLES = {"v": "o-", "a": "x-", "d": "^--", "c": "s:"}
WORKER_REPLICAS = 2  # config.yaml's and config.vllm.yaml's
VLLM_MIN_HEAD_DIM = 32  # vLLM-CPU's attention refuses narrower heads (the tiny preset's are 16)
OVER_VLLM_TARGET, OVER_OURS_TARGET, TARGET_HISTORY_TOKENS = 5.0, 1.3, 2000


@dataclass(frozen=True)
class Model:
    name: str
    moe: bool


DENSE, MOE = Model("dense", False), Model("moe", True)


# -- the sides --------------------------------------------------------------------------------------
def measure_model(plan: Plan, model: Model, scripts: list[Script], tmp: Path, vllm_python: Path | None,
                  sides: str) -> dict:
    """{side: record} of one checkpoint for the sides asked (of "vadc"); without vllm_python only (a)."""
    from workers.checkpoint import Arch, make_model

    head_dim = VLLM_MIN_HEAD_DIM if plan.preset == "tiny" else None
    model_dir = make_model(tmp / f"granitemoehybrid-{plan.preset}-{model.name}", Arch.GRANITEMOEHYBRID, plan.preset,
                           seed=plan.seed, moe=model.moe, attention_head_dim=head_dim)
    if vllm_python is None:
        sides = "a"
    modes: dict = {}
    if "v" in sides:
        modes["v"] = run_app(plan, model_dir, scripts, tmp, "config.vllm.yaml",
                             {"vllm_python": str(vllm_python)}, f"{model.name}-v")
    if "a" in sides:
        modes["a"] = run_app(plan, model_dir, scripts, tmp, "config.yaml", {}, f"{model.name}-a")
    for side, extra in (("d", ["--no-enable-prefix-caching"]), ("c", [])):
        if side in sides:
            server = VllmServer(vllm_python, model_dir, tmp, f"{model.name}-{side}", extra)
            try:
                modes[side] = server.run(
                    lambda url: run_mode(url, scripts, ConversationMode.STATELESS, side, plan))
            finally:
                server.stop()
    return modes


def run_app(plan: Plan, model_dir: Path, scripts: list[Script], tmp: Path, config_file: str, args: dict,
            name: str) -> dict:
    """The workload on `serve run` of config_file with args; a failed start is a result (tried
    twice: the free port it picked can be taken before Serve binds it, as happened once)."""
    for attempt in (1, 2):
        server, base_url, config = start_app(model_dir, tmp, config_file, args, f"{name}-{attempt}")
        rec: dict = {"config": config, "command": server.argv}
        try:
            rec["startup_s"] = server.wait_ready(900)
            break
        except (RuntimeError, TimeoutError) as exc:
            server.stop()
            rec["startup_error"] = str(exc)[-3000:]
    else:
        return rec
    rec.pop("startup_error", None)
    try:
        rec["warm_up"] = warm_replicas(base_url, plan)
        rec |= run_mode(base_url, scripts, ConversationMode.STORED, name, plan)
        if rec["errors"]:
            rec["server_log_errors"] = server.error_lines()
    finally:
        server.stop()
    return rec


def warm_replicas(base_url: str, plan: Plan, rounds: int = 8) -> dict:
    """Rounds of WORKER_REPLICAS one-turn conversations at once until every replica owns one. Their
    system prompts differ: the router sends a new conversation to a replica holding its prompt's
    prefix (our engine's prefix reuse), so alike ones would all go where the first went."""
    owners: set[str] = set()
    errors: list[str] = []
    t0 = time.perf_counter()
    for k in range(rounds):
        scripts = [Script(f"Warm-up conversation {k}.{i}.", ("Hello.",), (2,)) for i in range(WORKER_REPLICAS)]
        res = asyncio.run(run_workload(base_url, scripts, ConversationMode.STORED, f"warm{k}",
                                       plan.request_timeout_s, plan.mode_budget_s))
        errors += res.errors
        for rec in res.records:
            if rec.error is None:
                head = httpx.get(f"{base_url}/v1/conversations/{rec.conversation_id}",
                                 params={"cache_salt": "bench"}, timeout=10).json()["head"]
                owners.add(head["owner"])
        if len(owners) >= WORKER_REPLICAS or errors:
            break
    return {"rounds": k + 1, "replicas_warmed": len(owners), "wall_s": time.perf_counter() - t0, "errors": errors}


# -- summaries ---------------------------------------------------------------------------------------
def headline(modes: dict) -> dict:
    """At (v)'s last completed turn: every side's TTFT p50 over (v)'s (or how far it got), and the
    targets: vLLM's server over (v), (v) over our engine."""
    lt = last_turn({"modes": modes}, ref="v", others=("a", "d", "c"))
    out: dict = {"last_turn": lt}
    if lt is None:
        return out
    out["history_at_target"] = lt["prompt_tokens"] >= TARGET_HISTORY_TOKENS
    for side in ("d", "c"):
        if "ratio" in lt["modes"].get(side, {}):
            out[f"{side}_over_v"] = lt["modes"][side]["ratio"]
    if "ratio" in lt["modes"].get("a", {}):
        out["v_over_a"] = 1 / lt["modes"]["a"]["ratio"]
    return out


def run(plan: Plan, models: tuple[Model, ...], variant: str, skip_vllm: bool, sides: str = "vadc") -> dict:
    """variant: full, quick or smoke (the plan's name, for the report); sides: which of "vadc" run."""
    from workers.vllm_backend.venv import ensure_vllm_python

    res: dict = {"variant": variant, "plan": asdict(plan), "env": environment_info(), "labels": SIDES,
                 "models": {}, "not_run": [], "method": __doc__}
    res["env"]["load_average_start"] = load_average()
    res["plan"]["models"] = [asdict(m) for m in models]
    if len(models) < 2:
        res["not_run"].append(f"the models other than {', '.join(m.name for m in models)}: this plan runs only those")
    if skip_vllm:
        res["not_run"].append("(v), (d), (c): --skip-vllm (no vLLM environment): only our engine ran")
    elif set(sides) != set("vadc"):
        res["not_run"].append(f"{', '.join(f'({s})' for s in 'vadc' if s not in sides)}: --sides {sides}")
    python = None if skip_vllm else ensure_vllm_python()
    scripts = make_scripts(plan)
    with tempfile.TemporaryDirectory(prefix="bench-serve-vllm-") as tmp_name:
        for model in models:
            modes = measure_model(plan, model, scripts, Path(tmp_name), python, sides)
            res["models"][model.name] = {"modes": modes, "headline": headline(modes)}
    res["env"]["load_average_end"] = load_average()
    return res


# -- report -------------------------------------------------------------------------------------------
def markdown(res: dict) -> str:
    plan = res["plan"]
    variant = "" if res["variant"] == "full" else f" ({res['variant']})"
    lines = [f"# Serving benchmark, our app on the vLLM backend{variant}", "",
             f"{plan['conversations']} concurrent conversations x {plan['turns']} turns, GraniteMoeHybrid "
             f"`{plan['preset']}` checkpoints, greedy, streamed over HTTP with `openai`. "
             f"CPU: {res['env']['cpu']['model']} ({res['env']['cpu_count']} cores; "
             f"{', '.join(res['env']['cpu']['simd_flags'])}), load average at start "
             f"{res['env']['load_average_start']}, at the end {res['env']['load_average_end']}. Each app: 2 worker "
             f"replicas with 1 thread each; each vLLM server: {res['env']['cpu_count']} OpenMP threads.", ""]
    for name, rec in res["models"].items():
        modes, h = rec["modes"], rec["headline"]
        lines += [f"## {name}", ""]
        lines += mode_tables(modes, SIDES)
        for side, mode in modes.items():
            warm = mode.get("warm_up")
            if warm and (warm["errors"] or warm["replicas_warmed"] < WORKER_REPLICAS):
                lines.append(f"- {SIDES[side]}: warm-up reached {warm['replicas_warmed']} of {WORKER_REPLICAS} "
                             f"replicas in {warm['rounds']} rounds" + (f"; `{warm['errors'][0][:300]}`"
                                                                       if warm["errors"] else ""))
        lt = h.get("last_turn")
        if lt is None:
            lines += ["(v) completed no turn: no ratios.", ""]
            continue
        lines += [f"At (v)'s last turn ({lt['turn']}, {format_number(lt['prompt_tokens'], 0)} prompt tokens"
                  + ("" if h["history_at_target"] else f", short of the targets' {TARGET_HISTORY_TOKENS:,}")
                  + "):", "", last_turn_table(lt, SIDES, ref="v"), ""]
        for side in ("d", "c"):
            if f"{side}_over_v" in h:
                lines.append(f"- {SIDES[side]} over (v): {h[f'{side}_over_v']:.1f}x (target >= {OVER_VLLM_TARGET:g}x).")
            elif side in lt["modes"]:
                lines.append(f"- {SIDES[side]} over (v): not measured, it did not reach turn {lt['turn']}.")
        if "v_over_a" in h:
            target = f"target <= {OVER_OURS_TARGET:g}x" if name == DENSE.name else "no target on this model"
            lines.append(f"- (v) over (a): {h['v_over_a']:.2f}x ({target}).")
        lines.append("")
    for note in res["not_run"]:
        lines.append(f"- Not run: {note}")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["models"]), figsize=(7 * len(res["models"]), 5.5), squeeze=False)
    for ax, (name, rec) in zip(axes[0], res["models"].items()):
        plot_ttft(ax, rec["modes"], SIDES, STYLES, f"TTFT per turn over HTTP — {name}, "
                        f"{res['plan']['conversations']} concurrent conversations")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
