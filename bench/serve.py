"""Serving benchmark: `python -m bench.serve [--quick] [--skip-vllm] [--skip-app]`.

(`--backend vllm`: the workload below on our app with its workers on vLLM's engine, against
vLLM's server and our app on our engine, on a dense and an MoE checkpoint: bench/serve_vllm.py.)

N concurrent conversations x T turns over HTTP with the official `openai` client (streamed,
greedy, `stream_options.include_usage`), on the GraniteMoeHybrid `bench` checkpoint (random
weights, made in a temp dir), against, one at a time on an otherwise idle benchmark:

  (a) our app with the conversation cache: `serve run` of config.yaml (2 Worker replicas,
      1 torch thread each, the cache service and its embedded Redis started by the app);
      each turn sends only the new user message with `conversation_id` + `cache_salt`;
  (b) the same running app without reuse: stateless requests carrying the full history, each
      with a cache_salt of its own (a stateless request reuses the longest prefix held under
      its salt, so a shared salt would no longer measure recomputing the history);
  (c) vLLM's OpenAI server on its CPU build (`python -m vllm.entrypoints.openai.api_server`)
      with its defaults (prefix caching on), full history each turn. Its engine is expected
      to die on the first long chat (the failure is caught and recorded), so also
  (d) vLLM with `--no-enable-prefix-caching`.
  vLLM needs `--gpu-memory-utilization` lowered on this machine (it reserves that fraction
  of the NUMA node's memory and refuses to start when less is free), and `--dtype float32`:
  with `auto` it downcasts our fp32 checkpoint to its CPU platform's first dtype, bf16, which
  is emulated (slow) on CPUs without native bf16, while our app serves fp32; otherwise
  default flags.

Per turn: TTFT p50/p99 over the conversations (time to the first streamed content), prompt
tokens, `usage.prompt_tokens_details.cached_tokens`; per mode: output tokens/s (all
completion tokens / wall time), cache hit ratio (cached / prompt tokens).

Serving overhead: TTFT of a cached turn at a ~500-token history through HTTP (ingress,
sticky router, worker, cache-service gRPC: lease, publish) over the TTFT of the same turn in
an in-process engine (`LLMEngine` + `ConversationCache`, the worker's engine configuration,
stepped synchronously), median of K conversations each way, one request in flight, HTTP and
in-process samples alternating (the app idles while the in-process engine runs).

Order: our app first, then vLLM; each mode's workload has a wall-time budget, turns not
finished within it are reported as cut off (vLLM's CPU engine slows down badly when the
machine is oversubscribed: its OpenMP threads spin).

Then the prefix-reuse workloads of ordinary OpenAI clients, each side by side on the same app
and vLLM servers (bench/serve_prefix.py: multi-turn stateless clients with a round barrier, and
new conversations over a shared system prompt). A vLLM server whose engine died is started
again before the next workload (not in --smoke), so each workload records how far it gets.

Targets: (a) TTFT p50 >= 5x lower than (b) and than vLLM at the last turn of a >=2k-token
conversation; overhead <= 1.3x at a 500-token history.
Writes bench/results/serve.{json,md,png} (the quick run: serve.quick.*; --smoke, the tiny
checkpoint and one short conversation: serve.smoke.*; --results-dir elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from bench import serve_prefix
from bench.common import REPO_ROOT, RESULTS_DIR, chat_text, environment_info, format_number, markdown_table, write_results
from bench.serve_http import (
    ConversationMode,
    Script,
    ServerProcess,
    WorkloadResult,
    await_tier_export,
    free_port,
    run_workload,
)
from bench.serve_prefix import OUR_SIDES, PrefixPlan, Side

@dataclass(frozen=True)
class Plan:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    overhead_history_tokens: int  # history before the measured turn of the overhead probe
    overhead_samples: int
    request_timeout_s: float
    mode_budget_s: float  # wall-time budget of one mode's workload; turns not done by then are cut off
    prefix: PrefixPlan = serve_prefix.FULL
    restart_dead_vllm: bool = True  # start a vLLM server again for the next workload if its engine died
    seed: int = 0
    preset: str = "bench"


# The built-in tokenizer is one token per character, so lengths below are token counts.
FULL = Plan(conversations=2, turns=12, system_tokens=800, user_tokens=(80, 100), reply_tokens=(48, 52),
            overhead_history_tokens=500, overhead_samples=7, request_timeout_s=600, mode_budget_s=1200)
QUICK = Plan(conversations=2, turns=4, system_tokens=300, user_tokens=(60, 80), reply_tokens=(8, 12),
             overhead_history_tokens=500, overhead_samples=3, request_timeout_s=300, mode_budget_s=600,
             prefix=serve_prefix.QUICK)
# Proves the benchmark runs (CI, tests/bench): the tiny checkpoint, one short conversation; measures nothing.
SMOKE = Plan(conversations=1, turns=2, system_tokens=60, user_tokens=(10, 16), reply_tokens=(2, 3),
             overhead_history_tokens=200, overhead_samples=1, request_timeout_s=300, mode_budget_s=600,
             prefix=serve_prefix.SMOKE, restart_dead_vllm=False, preset="tiny")

MODES = {
    "a": "(a) our app, conversation cache on",
    "b": "(b) our app, no reuse (stateless, full history, a cache_salt per request)",
    "c": "(c) vLLM server, defaults (prefix caching on)",
    "d": "(d) vLLM server, --no-enable-prefix-caching",
}
VLLM_MEMORY_FRACTION = "0.3"


def make_scripts(plan: Plan) -> list[Script]:
    rng = random.Random(plan.seed)
    scripts = []
    for c in range(plan.conversations):
        system = chat_text(rng, plan.system_tokens, f"You are assistant #{c}. Answer carefully.")
        users = tuple(chat_text(rng, rng.randint(*plan.user_tokens), f"Question {t + 1}:") for t in range(plan.turns))
        replies = tuple(rng.randint(*plan.reply_tokens) for _ in range(plan.turns))
        scripts.append(Script(system, users, replies))
    return scripts


def overhead_script(plan: Plan, index: int) -> Script:
    """Turn 1 builds a ~overhead_history_tokens history; turn 2 is the one measured."""
    rng = random.Random(1000 + index)
    system = chat_text(rng, plan.overhead_history_tokens - 120, f"Overhead probe {index}.")
    return Script(system, (chat_text(rng, 60, "Question 1:"), chat_text(rng, 60, "Question 2:")), (40, 16))


# -- facts about the machine ------------------------------------------------------------------------
def cpu_info() -> dict:
    info = {"model": None, "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and info["model"] is None:
            info["model"] = value.strip()
        if key.strip() == "flags" and not info["flags"]:
            wanted = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "bf16")
            info["flags"] = sorted(f for f in value.split() if f.startswith(wanted))
    return info


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- (a) and (b): our app ---------------------------------------------------------------------------
def app_config(model_dir: Path, data_dir: Path, port: int, config_file: str = "config.yaml",
               args: dict | None = None) -> dict:
    """config_file (config.yaml) as users run it, with the benchmark's model, a private data dir,
    loopback only, and `args` set."""
    config = yaml.safe_load((REPO_ROOT / config_file).read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    (application,) = config["applications"]
    application["args"] |= {"model": str(model_dir), "data_dir": str(data_dir)} | (args or {})
    return config


def start_app(model_dir: Path, tmp: Path, config_file: str = "config.yaml", args: dict | None = None,
              name: str = "serve") -> tuple[ServerProcess, str, dict]:
    """`serve run` of config_file; its config, data and log in tmp under `name`."""
    port = free_port()
    config = app_config(model_dir, tmp / f"{name}-data", port, config_file, args)
    path = tmp / f"{name}-config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)  # a cluster of its own, never someone else's
    serve_bin = Path(sys.executable).with_name("serve")
    server = ServerProcess("serve run", [str(serve_bin), "run", str(path)], env, REPO_ROOT,
                           tmp / f"{name}.log", f"http://127.0.0.1:{port}/health")
    return server, f"http://127.0.0.1:{port}", config


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


# -- the in-process reference of the overhead ------------------------------------------------------
class InProcessReference:
    """The overhead probe's conversations in an engine stepped in this process, configured as a
    Worker replica configures its own (deployments/worker/engine_session.py) from config.yaml's args."""

    def __init__(self, plan: Plan, model_dir: Path):
        import torch

        from deployments.settings import AppSettings
        from workers.config import CacheConfig, EngineConfig, SchedulerConfig
        from workers.conversation.cache import ConversationCache
        from workers.engine import LLMEngine

        (application,) = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())["applications"]
        settings = AppSettings.model_validate(application["args"] | {"model": str(model_dir)})
        torch.set_num_threads(settings.torch_threads)
        self.plan, self.threads = plan, settings.torch_threads
        self.engine = LLMEngine(EngineConfig(
            model=str(model_dir), num_threads=settings.torch_threads, max_model_len=settings.max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=settings.max_num_seqs),
            cache=CacheConfig(kv_cache_bytes=settings.kv_cache_mb << 20,
                              head_cache_bytes=settings.head_cache_mb << 20)))
        self.cache = ConversationCache(self.engine, retain_turns=2)

    def _turn(self, conv: str, messages: list[dict], max_tokens: int, request_id: str) -> tuple[float, object]:
        from proto.contract import ConversationRef
        from workers.sampling import SamplingParams

        t0 = time.perf_counter()
        request = self.cache.begin_turn(ConversationRef(conv, "bench"), messages,
                                        SamplingParams(max_tokens=max_tokens, temperature=0), request_id)
        first = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error:
                    raise RuntimeError(out.error)
                if first is None and out.new_tokens:
                    first = time.perf_counter() - t0
        return first, request

    def probe(self, k: int) -> tuple[float, int, int]:
        """Turn 1 of probe conversation k, then turn 2 measured: (TTFT, prompt tokens, reused tokens)."""
        script, conv = overhead_script(self.plan, k), f"oh{k}"
        self._turn(conv, [{"role": "system", "content": script.system}, {"role": "user", "content": script.users[0]}],
                   script.replies[0], f"{conv}-1")
        ttft, request = self._turn(conv, [{"role": "user", "content": script.users[1]}], script.replies[1], f"{conv}-2")
        return ttft, request.num_prompt_tokens, request.num_cached_tokens


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


class VllmServer:
    """One vLLM OpenAI server configuration, started again on demand after its engine died."""

    def __init__(self, python: Path, model_dir: Path, tmp: Path, mode: str, extra: list[str]):
        self.python, self.model_dir, self.tmp, self.mode, self.extra = python, model_dir, tmp, mode, extra
        self.starts = 0
        self.server: ServerProcess | None = None
        self.startup_s: float | None = None
        self.startup_error: str | None = None
        self._start()

    def _start(self) -> None:
        from workers.vllm_backend.venv import vllm_env

        port = free_port()
        self.argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                     "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", VLLM_MEMORY_FRACTION,
                     "--dtype", "float32", *self.extra]
        self.starts += 1
        self.url = f"http://127.0.0.1:{port}"
        self.server = ServerProcess(f"vllm ({self.mode})", self.argv, vllm_env(), self.tmp,
                                    self.tmp / f"vllm-{self.mode}-{self.starts}.log", f"{self.url}/health")
        try:
            self.startup_s, self.startup_error = self.server.wait_ready(900), None
        except (RuntimeError, TimeoutError) as exc:
            self.startup_s, self.startup_error = None, str(exc)[-3000:]

    def healthy(self) -> bool:
        import httpx

        if self.server is None or not self.server.alive():
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        except httpx.TransportError:
            return False

    def restart_if_dead(self) -> None:
        if not self.healthy():
            self.stop()
            self._start()

    def run(self, work) -> dict:
        """work(base_url)'s record, with the server's start and, after errors, its log."""
        rec: dict = {"command": self.argv, "server_start": self.starts}
        if self.startup_error is not None:
            return rec | {"startup_error": self.startup_error}
        rec["startup_s"] = self.startup_s
        rec |= work(self.url)
        rec["server_alive_after"] = self.healthy()
        if rec["errors"]:
            rec["server_log_tail"] = self.server.tail(40)
            rec["server_log_errors"] = self.server.error_lines()
        return rec

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(30)
            self.server = None


# -- summaries -----------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


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


# -- report -----------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:,.0f}"


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
                       f"{_ms(pt['ttft_p50_s'])} / {_ms(pt['ttft_p99_s'])} ({format_number(pt['prompt_tokens_mean'], 0)} tok)")
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
    rows = [[labels[ref], _ms(lt[f"{ref}_ttft_p50_s"]), "1.0x"]]
    for m, r in lt["modes"].items():
        if "ratio" in r:
            rows.append([labels[m], _ms(r["ttft_p50_s"]), f"{r['ratio']:.1f}x"])
        else:
            rows.append([labels[m], f"— (reached turn {r['reached_turn']}"
                         + (f", {format_number(r['reached_prompt_tokens'], 0)} tok" if r["reached_turn"] else "")
                         + f"; {r['stopped_because'][:120]})", "—"])
    return markdown_table(["mode", "TTFT p50 ms", f"over ({ref})"], rows)


def markdown(res: dict) -> str:
    modes, h = res["modes"], res["headline"]
    lines = [f"# Serving benchmark{' (quick)' if res['quick'] else ''}", "",
             f"{res['plan']['conversations']} concurrent conversations x {res['plan']['turns']} turns, "
             f"GraniteMoeHybrid `{res['plan'].get('preset', 'bench')}` checkpoint, greedy, streamed over HTTP with `openai`. "
             f"CPU: {res['env']['cpu']['model']} ({res['env']['cpu_count']} cores), load average at start "
             f"{res['env']['load_average_1_5_15m']}. The machine was shared with other work.", ""]
    lines += mode_tables(modes, MODES)
    if h.get("last_turn"):
        lt = h["last_turn"]
        lines += [f"At the last turn ({lt['turn']}, {format_number(lt['prompt_tokens'], 0)} prompt tokens; "
                  f"target >= 5x at >= 2k tokens):", "", last_turn_table(lt, MODES), ""]
    for m, r in h["ttft_p50_ratio_over_a"].items():
        lines.append(f"- {MODES[m]} over (a) at turn {r['turn']} ({format_number(r['prompt_tokens'], 0)} prompt "
                     f"tokens), the last both completed: TTFT p50 {_ms(r['other_ttft_p50_s'])} ms / "
                     f"{_ms(r['a_ttft_p50_s'])} ms = {r['ratio']:.1f}x (target >= 5x at a >= 2k-token history).")
    if "overhead_ratio" in h:
        oh = res["overhead"]
        lines.append(f"Serving overhead at a {h['overhead_history_tokens']:.0f}-token history "
                     f"({h['overhead_prompt_tokens']:.0f}-token prompt): HTTP TTFT "
                     f"{_ms(statistics.median(t for t in oh['http']['ttft_s'] if t is not None))} ms / in-process "
                     f"{_ms(statistics.median(oh['in_process']['ttft_s']))} ms = {h['overhead_ratio']:.2f}x "
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


# -- main -----------------------------------------------------------------------------------------
def run(plan: Plan, quick: bool, skip_vllm: bool, skip_app: bool, vllm_results: Path | None) -> dict:
    from workers.checkpoint import make_model

    env = environment_info() | {"cpu": cpu_info()}
    res: dict = {"quick": quick, "plan": asdict(plan), "env": env, "modes": {}, "overhead": {}, "not_run": [],
                 "prefix": {w: {} for w in serve_prefix.WORKLOADS}, "labels": MODES,
                 "method": __doc__ + "\n" + serve_prefix.__doc__}
    scripts = make_scripts(plan)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = make_model(tmp / f"granitemoehybrid-{plan.preset}", "granitemoehybrid", plan.preset, seed=0)
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
            if earlier["plan"] != json.loads(json.dumps(res["plan"])):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 conversations x 4 short turns; 8 x 4 multi-turn "
                                                             "clients; 16 shared-prompt conversations")
    parser.add_argument("--skip-vllm", action="store_true", help="only our app")
    parser.add_argument("--skip-app", action="store_true", help="only vLLM")
    parser.add_argument("--vllm-results", type=Path, help="take (c), (d) from an earlier run's JSON (same plan)")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint, one short conversation: proves it runs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--backend", choices=("ours", "vllm"), default="ours",
                        help="vllm: the multi-turn workload on our app's vLLM backend, vLLM's server and our "
                             "engine (bench/serve_vllm.py)")
    parser.add_argument("--sides", default="vadc", help="--backend vllm: which sides run, of v (our app on vLLM), a "
                                                         "(our engine), d and c (vLLM's server, prefix caching off/on)")
    args = parser.parse_args()
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.backend == "vllm":
        if args.skip_app or args.vllm_results:
            parser.error("--backend vllm runs every side itself: no --skip-app or --vllm-results")
        if not args.sides or set(args.sides) - set("vadc"):
            parser.error(f"--sides takes letters of vadc, not {args.sides!r}")
        main_vllm_backend(plan, args)
        return
    res = run(plan, args.quick or args.smoke, args.skip_vllm, args.skip_app, args.vllm_results)
    stem = "serve.smoke" if args.smoke else "serve.quick" if args.quick else "serve"
    md = markdown(res)
    write_results(stem, res, md, args.results_dir)
    if res["modes"] or any(res["prefix"].values()):
        plot(res, args.results_dir / f"{stem}.png")
    print(md)
    print(json.dumps(res["headline"] | {"prefix": res["prefix_headline"]}, indent=2))


def main_vllm_backend(plan: Plan, args: argparse.Namespace) -> None:
    from bench import serve_vllm  # it builds on this module

    models = (serve_vllm.DENSE,) if args.smoke else (serve_vllm.DENSE, serve_vllm.MOE)
    variant = "smoke" if args.smoke else "quick" if args.quick else "full"
    res = serve_vllm.run(plan, models, variant, args.skip_vllm, args.sides)
    stem = "serve.vllm.smoke" if args.smoke else "serve.vllm.quick" if args.quick else "serve.vllm"
    md = serve_vllm.markdown(res)
    write_results(stem, res, md, args.results_dir)
    serve_vllm.plot(res, args.results_dir / f"{stem}.png")
    print(md)
    print(json.dumps({name: rec["headline"] for name, rec in res["models"].items()}, indent=2))


if __name__ == "__main__":
    main()
