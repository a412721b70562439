"""The prefix-reuse workloads of `bench.serve`: ordinary OpenAI clients that resend their history.

  multi-turn   C concurrent clients x T turns (as vLLM's benchmarks/multi_turn and SGLang's
               bench_multiturn), every turn the full history, a round barrier (every client
               finishes turn t before any starts t + 1): TTFT p50/p99 and the hit ratio by turn;
  shared       N new conversations over one long system prompt, P at a time, each its first
               turn only: first-turn TTFT p50/p99.

Sides, one after another on an otherwise idle benchmark (each its own cache_salt, so no side
finds what another left):

  explicit     our app, conversation_id + the new message (first turns: the system prompt too)
  reuse        our app, stateless, one cache_salt per workload: the longest prefix held is reused
  reuse_off    our app, stateless, a cache_salt of its own per request: nothing held can match.
               Chosen over a second app with `prefix_cache_mb: 0` because every side then runs on
               the same warm replicas of one app start (an app start is minutes on 2 cores); the
               cost is that these requests still make checkpoints they never use (a prefill cut at
               each message boundary, a state snapshot there and at the end, their announcements),
               so this side is a little slower than an app without a prefix cache would be.
  vllm_on      vLLM's OpenAI server, defaults (prefix caching on): full history, no extra field
  vllm_off     vLLM with --no-enable-prefix-caching

Hit ratio of a turn: cached / prompt tokens. History hit ratio (from turn 2): cached tokens
over the tokens of the previous turn's prompt and reply, the history the new turn resends.
"""

from __future__ import annotations

import asyncio
import enum
import random
import re
from dataclasses import dataclass

from bench.kit.chat_client import ConversationMode, Schedule, Script, WorkloadResult, run_workload
from bench.kit.chat_text import chat_text
from bench.kit.tables import format_number, markdown_table, ms, percent


@dataclass(frozen=True)
class PrefixPlan:
    clients: int  # multi-turn: concurrent clients
    turns: int
    system_tokens: int
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    shared_conversations: int  # shared system prompt: new conversations
    shared_concurrency: int
    shared_system_tokens: int
    shared_user_tokens: tuple[int, int]
    shared_reply_tokens: int


FULL = PrefixPlan(clients=16, turns=8, system_tokens=800, user_tokens=(60, 100), reply_tokens=(16, 24),
                  shared_conversations=64, shared_concurrency=4, shared_system_tokens=2000,
                  shared_user_tokens=(40, 80), shared_reply_tokens=8)
QUICK = PrefixPlan(clients=8, turns=4, system_tokens=400, user_tokens=(50, 70), reply_tokens=(8, 12),
                   shared_conversations=16, shared_concurrency=2, shared_system_tokens=2000,
                   shared_user_tokens=(40, 80), shared_reply_tokens=8)
SMOKE = PrefixPlan(clients=2, turns=2, system_tokens=60, user_tokens=(10, 16), reply_tokens=(2, 3),
                   shared_conversations=2, shared_concurrency=1, shared_system_tokens=100,
                   shared_user_tokens=(10, 16), shared_reply_tokens=2)


class Side(str, enum.Enum):
    EXPLICIT = "explicit"
    REUSE = "reuse"
    REUSE_OFF = "reuse_off"
    VLLM_ON = "vllm_on"
    VLLM_OFF = "vllm_off"


SIDES = {
    Side.EXPLICIT: ("ours, explicit conversation (conversation_id + new message)", ConversationMode.STORED),
    Side.REUSE: ("ours, stateless, prefix reuse", ConversationMode.SALTED),
    Side.REUSE_OFF: ("ours, stateless, reuse off (a cache_salt per request)", ConversationMode.FRESH_SALT),
    Side.VLLM_ON: ("vLLM, prefix caching on (default)", ConversationMode.STATELESS),
    Side.VLLM_OFF: ("vLLM, --no-enable-prefix-caching", ConversationMode.STATELESS),
}
OUR_SIDES = (Side.EXPLICIT, Side.REUSE, Side.REUSE_OFF)
SHORT = {Side.EXPLICIT: "ours\nexplicit", Side.REUSE: "ours\nreuse", Side.REUSE_OFF: "ours\nreuse off",
         Side.VLLM_ON: "vLLM\nprefix on", Side.VLLM_OFF: "vLLM\nprefix off"}
WORKLOADS = {"multiturn": "multi-turn stateless clients", "shared": "shared system prompt"}


def multiturn_scripts(plan: PrefixPlan, seed: int) -> list[Script]:
    rng = random.Random(seed + 7)
    scripts = []
    for c in range(plan.clients):
        system = chat_text(rng, plan.system_tokens, f"You are helper #{c} of a multi-turn chat.")
        users = tuple(chat_text(rng, rng.randint(*plan.user_tokens), f"Ask {t + 1}:") for t in range(plan.turns))
        scripts.append(Script(system, users, tuple(rng.randint(*plan.reply_tokens) for _ in range(plan.turns))))
    return scripts


def shared_scripts(plan: PrefixPlan, seed: int) -> list[Script]:
    rng = random.Random(seed + 11)
    system = chat_text(rng, plan.shared_system_tokens, "You are the support assistant of a shop. Rules follow.")
    return [Script(system, (chat_text(rng, rng.randint(*plan.shared_user_tokens), f"Customer {i}:"),),
                   (plan.shared_reply_tokens,)) for i in range(plan.shared_conversations)]


def run_side(base_url: str, workload: str, side: Side, plan: PrefixPlan, seed: int, request_timeout_s: float,
             budget_s: float, summarize) -> dict:
    """One side of one workload; `summarize` is bench.serve's summary of a WorkloadResult."""
    _, mode = SIDES[side]
    tag = f"{workload}-{side.value}"
    if workload == "multiturn":
        res: WorkloadResult = asyncio.run(run_workload(base_url, multiturn_scripts(plan, seed), mode, tag,
                                                       request_timeout_s, budget_s, Schedule.ROUNDS))
    else:
        res = asyncio.run(run_workload(base_url, shared_scripts(plan, seed), mode, tag, request_timeout_s, budget_s,
                                       Schedule.POOL, plan.shared_concurrency))
    return summarize(res)


# -- targets ---------------------------------------------------------------------------------------
def _turns(rec: dict | None) -> dict[int, dict]:
    if not rec or "per_turn" not in rec:
        return {}
    return {t["turn"]: t for t in rec["per_turn"] if t["completed"]}


def _reach(rec: dict | None) -> str:
    """How far a side got, and why it stopped."""
    if rec is None:
        return "not run"
    if rec.get("startup_error"):
        return f"did not start: {rec['startup_error'][-160:]}"
    done = _turns(rec)
    died = " (the server no longer answered /health)" if rec.get("server_alive_after") is False else ""
    why = (rec.get("errors") or ["no error recorded"])[0][:160] + died
    return f"reached turn {max(done, default=0)}; {why}"


def root_cause(rec: dict) -> str:
    """The first exception its server logged (vLLM's engine dies with a traceback in its log)."""
    for line in rec.get("server_log_errors", []):
        if " ERROR " in line and re.search(r"\b\w+(Error|Exception): ", line):
            return f"; its log's first exception: `{line.split('] ', 1)[-1][:200]}`"
    return ""


def headline(prefix: dict) -> dict:
    """The targets: multi-turn hit ratio of the history >= 90% from turn 2, last-turn TTFT p50
    within 1.2x of explicit mode and >= 5x lower than vLLM's; shared prompt first-turn TTFT p50
    >= 5x lower than with reuse off."""
    out: dict = {}
    mt = prefix.get("multiturn", {})
    reuse = _turns(mt.get(Side.REUSE.value))
    if reuse:
        later = [t for t in reuse.values() if t["turn"] >= 2 and t["history_hit_ratio"] is not None]
        last = max(reuse)
        m: dict = {"last_turn": last, "reuse_ttft_p50_s": reuse[last]["ttft_p50_s"],
                   "min_history_hit_ratio_from_turn_2": min((t["history_hit_ratio"] for t in later), default=None),
                   "over_reuse": {}}
        for side in (Side.EXPLICIT, Side.REUSE_OFF, Side.VLLM_ON, Side.VLLM_OFF):
            rec = mt.get(side.value)
            if rec is None:
                continue
            done = _turns(rec)
            if last in done:
                m["over_reuse"][side.value] = {"ttft_p50_s": done[last]["ttft_p50_s"],
                                               "ratio": done[last]["ttft_p50_s"] / reuse[last]["ttft_p50_s"]}
            else:
                m["over_reuse"][side.value] = {"stopped": _reach(rec)}
                common = sorted(done.keys() & reuse.keys())
                if common:  # what it measured before it stopped, at its last turn
                    t = common[-1]
                    m["over_reuse"][side.value] |= {"at_turn": t, "at_turn_ttft_p50_s": done[t]["ttft_p50_s"],
                                                    "at_turn_ratio": done[t]["ttft_p50_s"] / reuse[t]["ttft_p50_s"]}
        out["multiturn"] = m
    sh = prefix.get("shared", {})
    first = _turns(sh.get(Side.REUSE.value)).get(1)
    if first:
        s: dict = {"reuse_ttft_p50_s": first["ttft_p50_s"], "reuse_ttft_p99_s": first["ttft_p99_s"], "over_reuse": {}}
        for side in (Side.EXPLICIT, Side.REUSE_OFF, Side.VLLM_ON, Side.VLLM_OFF):
            rec = sh.get(side.value)
            if rec is None:
                continue
            other = _turns(rec).get(1)
            s["over_reuse"][side.value] = ({"ttft_p50_s": other["ttft_p50_s"],
                                            "ratio": other["ttft_p50_s"] / first["ttft_p50_s"]}
                                           if other else {"stopped": _reach(rec)})
        out["shared"] = s
    return out


# -- report ----------------------------------------------------------------------------------------
def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "NOT met")


def markdown(prefix: dict, plan: dict, h: dict) -> list[str]:
    lines: list[str] = []
    mt, sh = prefix.get("multiturn", {}), prefix.get("shared", {})
    sides = [s for s in Side if s.value in mt]
    if sides:
        lines += [f"## Multi-turn stateless clients: {plan['clients']} clients x {plan['turns']} turns, round barrier",
                  "", "TTFT p50 / p99 ms by turn (hit ratio: cached / prompt tokens; history: cached / the previous "
                  "turn's prompt + reply):", ""]
        turns = max((len(mt[s.value].get("per_turn", [])) for s in sides), default=0)
        rows = []
        for i in range(turns):
            row = [str(i + 1)]
            for s in sides:
                per = mt[s.value].get("per_turn", [])
                t = per[i] if i < len(per) else None
                if not t or not t["completed"]:
                    row.append("—")
                    continue
                hits = "" if t["hit_ratio"] is None else f", hit {percent(t['hit_ratio'])}"
                hist = "" if t["history_hit_ratio"] is None else f", history {percent(t['history_hit_ratio'])}"
                row.append(f"{ms(t['ttft_p50_s'])} / {ms(t['ttft_p99_s'])} "
                           f"({format_number(t['prompt_tokens_mean'], 0)} tok{hits}{hist})")
            rows.append(row)
        lines += [markdown_table(["turn", *[SIDES[s][0] for s in sides]], rows)]
        lines += [markdown_table(["side", "turns done", "wall s", "errors"],
                                 [[SIDES[s][0], str(mt[s.value].get("turns_completed", 0)),
                                   f"{mt[s.value].get('wall_s', 0):.1f}", str(len(mt[s.value].get("errors", [])))]
                                  for s in sides])]
        for s in sides:
            if mt[s.value].get("errors") or mt[s.value].get("startup_error"):
                lines.append(f"- {SIDES[s][0]}: {_reach(mt[s.value])}{root_cause(mt[s.value])}")
        m = h.get("multiturn")
        if m:
            hist = m["min_history_hit_ratio_from_turn_2"]
            lines += ["", f"Targets at the last turn ({m['last_turn']}; stateless with reuse: TTFT p50 "
                      f"{ms(m['reuse_ttft_p50_s'])} ms):", ""]
            rows = [["history hit ratio >= 90% from turn 2", f"lowest {percent(hist)}",
                     _verdict(None if hist is None else hist >= 0.9)]]
            for side, want in ((Side.EXPLICIT, "reuse within 1.2x of explicit"),
                               (Side.VLLM_ON, "vLLM on >= 5x over reuse"),
                               (Side.VLLM_OFF, "vLLM off over reuse (info)"),
                               (Side.REUSE_OFF, "reuse off over reuse (info)")):
                r = m["over_reuse"].get(side.value)
                if r is None:
                    continue
                if "ratio" not in r:
                    before = (f"; at turn {r['at_turn']}: {ms(r['at_turn_ttft_p50_s'])} ms = "
                              f"{r['at_turn_ratio']:.2f}x reuse's" if "at_turn" in r else "")
                    rows.append([want, f"— ({r['stopped']}){before}", _verdict(None)])
                    continue
                if side is Side.EXPLICIT:
                    measured, ok = f"explicit {ms(r['ttft_p50_s'])} ms; reuse / explicit = {1 / r['ratio']:.2f}x", \
                        1 / r["ratio"] <= 1.2
                else:
                    measured, ok = f"{ms(r['ttft_p50_s'])} ms = {r['ratio']:.2f}x reuse's", \
                        r["ratio"] >= 5 if side is Side.VLLM_ON else None
                rows.append([want, measured, _verdict(ok)])
            lines += [markdown_table(["target", "measured", "verdict"], rows)]
    sides = [s for s in Side if s.value in sh]
    if sides:
        lines += [f"## Shared system prompt: {plan['shared_conversations']} new conversations over a "
                  f"{plan['shared_system_tokens']}-token system prompt, {plan['shared_concurrency']} at a time", ""]
        s_h = h.get("shared", {})
        rows = []
        for s in sides:
            rec = sh[s.value]
            t = _turns(rec).get(1)
            ratio = s_h.get("over_reuse", {}).get(s.value, {}).get("ratio")
            rows.append([SIDES[s][0], str(t["completed"] if t else 0), ms(t and t["ttft_p50_s"]),
                         ms(t and t["ttft_p99_s"]), percent(t and t["hit_ratio"]),
                         "1.00x" if s is Side.REUSE and t else "—" if ratio is None else f"{ratio:.2f}x"])
        lines += ["First-turn TTFT:", "", markdown_table(["side", "done", "TTFT p50 ms", "TTFT p99 ms", "hit ratio",
                                                          "p50 over reuse"], rows)]
        for s in sides:
            if sh[s.value].get("errors") or sh[s.value].get("startup_error"):
                lines.append(f"- {SIDES[s][0]}: {_reach(sh[s.value])}{root_cause(sh[s.value])}")
        off = s_h.get("over_reuse", {}).get(Side.REUSE_OFF.value, {})
        if "ratio" in off:
            lines += ["", f"Target: first-turn TTFT p50 with reuse >= 5x lower than with reuse off: "
                      f"{off['ratio']:.1f}x, {_verdict(off['ratio'] >= 5)}.", ""]
    return lines


def plot(ax_turns, ax_shared, prefix: dict) -> None:
    styles = {Side.EXPLICIT: "o-", Side.REUSE: "s-", Side.REUSE_OFF: "x--", Side.VLLM_ON: "^:", Side.VLLM_OFF: "v:"}
    mt, sh = prefix.get("multiturn", {}), prefix.get("shared", {})
    for s in Side:
        pts = [(t, r["ttft_p50_s"] * 1e3) for t, r in sorted(_turns(mt.get(s.value)).items())]
        if pts:
            ax_turns.plot(*zip(*pts), styles[s], label=SIDES[s][0])
    ax_turns.set_yscale("log")
    ax_turns.xaxis.get_major_locator().set_params(integer=True)
    ax_turns.set_xlabel("turn")
    ax_turns.set_ylabel("TTFT p50 (ms, log scale)")
    ax_turns.set_title("Multi-turn stateless clients (round barrier)", fontsize=10)
    ax_turns.grid(True, which="both", alpha=0.3)
    if ax_turns.get_lines():
        ax_turns.legend(fontsize=7)
    bars = [(s, _turns(sh.get(s.value)).get(1)) for s in Side if s.value in sh]
    bars = [(s, t) for s, t in bars if t]
    if bars:
        x = range(len(bars))
        p50 = [t["ttft_p50_s"] * 1e3 for _, t in bars]
        p99 = [t["ttft_p99_s"] * 1e3 for _, t in bars]
        ax_shared.bar(x, p50, label="p50")
        ax_shared.scatter(x, p99, marker="_", s=300, color="black", label="p99", zorder=3)
        for i, v in zip(x, p50):
            ax_shared.annotate(f"{v:,.0f}", (i, v), ha="center", va="bottom", fontsize=7)
        ax_shared.set_xticks(list(x), [SHORT[s] for s, _ in bars], fontsize=8)
        ax_shared.set_yscale("log")
        ax_shared.legend(fontsize=7)
    ax_shared.set_ylabel("first-turn TTFT (ms, log scale)")
    ax_shared.set_title("Shared system prompt", fontsize=10)
    ax_shared.grid(True, axis="y", which="both", alpha=0.3)
