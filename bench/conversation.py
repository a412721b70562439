"""Conversation cache benchmark: `python -m bench.conversation [--quick]`.

C conversations x T turns on the `bench` checkpoint (random weights, written to a temp
dir): a system prompt of a few hundred tokens, user turns of ~60-100 tokens, greedy
replies of a fixed, per-turn length (temperature 0, ignore_eos). Per turn, side by side
in one run (the order of the modes rotates from turn to turn), TTFT and total time of

  (a)   the exact conversation cache: `ConversationCache.begin_turn` continues the
        committed head (terminal Mamba state at the committed length, all KV blocks);
  (b)   block-aligned reuse as vLLM's "align" mode does it, with vLLM's hybrid block size
        (the smallest multiple of 16 tokens whose attention page holds one sequence's
        Mamba state of one layer). Method: its own engine with
        CacheConfig(block_size=B, mamba_align_tokens=B) and its own ConversationCache.
        After each turn is published, the head is cut back to what align mode keeps:
        the KV table is truncated to the last full block (aligned_len = state_len // B * B)
        and the head's terminal Mamba slot is overwritten with its block-aligned snapshot
        (taken by the engine during the forward at the boundary), and head.state_len is set
        to aligned_len. The next begin_turn therefore attaches at aligned_len and the
        engine recomputes [aligned_len, committed) plus the new suffix: the same prompt
        token ids, only less reuse. The cut happens between turns, outside the timings;
  (b16) the same with B = 16 (reference);
  (c)   no reuse: a plain stateless `add_request` of (a)'s full prompt token ids;
  (d)   `transformers` `generate` (same checkpoint, greedy, same max_new_tokens) on the
        same prompt ids; TTFT = a 1-new-token generate, total = the full generate. Only
        on a few turns of the first conversation (it is slow).

TTFT = wall time from submitting the request (begin_turn / add_request included) to
the end of the first engine.step() that returns a token for it; the engine is stepped
synchronously with one conversation in flight. The machine is shared, so each mode's TTFT
is the minimum of 4 samples per turn (the median is reported too): 3 probes (submit, first
token, abort: the turn is discarded and the head untouched) and the real turn. Total =
the real turn (one sample).

Replies are exactly max_tokens tokens (ignore_eos); a greedy reply may contain
<|end_of_turn|> mid-text, which the ledger keeps (the cache still hits; `cache_stats`
and the per-mode reused/computed token counts show it).

Correctness: (a)'s greedy tokens must
equal (c)'s on every turn (recorded, and the exit status is 1 if not).

Writes bench/results/conversation.{json,md,png} (the quick run: conversation.quick.*).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workers.checkpoint import make_model
from workers.checkpoint.tokens import EOS_TOKEN_ID, NEVER_SAMPLE_TOKEN_IDS, PAD_TOKEN_ID
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.conversation.cache import ConversationCache
from workers.conversation.ledger import conversation_key
from workers.conversation.prompt import build_turn_prompt
from workers.engine import LLMEngine
from workers.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
THREADS = 2
PROBES = 3  # extra TTFT samples per mode and turn (TTFT = min of PROBES + 1; median kept too)
KERNEL_BLOCK = 16  # vLLM rounds the hybrid attention block size to a multiple of this
SALT = "bench"
ENGINE_MODES = ("a", "b", "b16", "c")
LABELS = {
    "a": "(a) exact conversation cache",
    "b": "(b) block-aligned reuse (vLLM align, B={B})",
    "b16": "(b16) block-aligned reuse, B=16",
    "c": "(c) no reuse (full recompute)",
    "d": "(d) transformers generate (full history)",
}

WORDS = (
    "the model cache state turn reply token layer block prefix history user system please "
    "explain why how what when which small large fast slow exact aligned recurrent attention "
    "conversation request server replica memory compute again next first last value number "
    "list table order simple careful result check answer question detail example short long"
).split()


@dataclass(frozen=True)
class Plan:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    hf_turns: tuple[int, ...]  # 1-based turns of conversation 0 measured with transformers
    seed: int = 0


# Sized for ~10 minutes on 2 idle cores (decode of the replies, 4 modes, dominates).
FULL = Plan(conversations=1, turns=12, system_tokens=800, user_tokens=(80, 100), reply_tokens=(48, 52), hf_turns=(1, 6, 12))
QUICK = Plan(conversations=1, turns=3, system_tokens=300, user_tokens=(60, 80), reply_tokens=(8, 12), hf_turns=(3,))


# -- workload ---------------------------------------------------------------------------------
def text_of(rng: random.Random, n_chars: int, lead: str = "") -> str:
    """About n_chars characters of words (the built-in tokenizer is one token per character)."""
    out = lead
    while len(out) < n_chars:
        out += (" " if out else "") + rng.choice(WORDS)
    return out[:n_chars].rstrip() + "."


@dataclass
class Script:
    system: str
    users: list[str]
    replies: list[int]  # max_tokens per turn


def make_scripts(plan: Plan) -> list[Script]:
    rng = random.Random(plan.seed)
    scripts = []
    for c in range(plan.conversations):
        system = text_of(rng, plan.system_tokens, f"You are assistant #{c}. Answer carefully.")
        users = [text_of(rng, rng.randint(*plan.user_tokens), f"Question {t + 1}:") for t in range(plan.turns)]
        replies = [rng.randint(*plan.reply_tokens) for _ in range(plan.turns)]
        scripts.append(Script(system, users, replies))
    return scripts


def suffix_of(script: Script, turn: int) -> list[dict]:
    user = {"role": "user", "content": script.users[turn]}
    return [{"role": "system", "content": script.system}, user] if turn == 0 else [user]


# -- block size as vLLM picks it for hybrid models ----------------------------------------------
def vllm_hybrid_block_size(engine: LLMEngine) -> dict:
    kv, st = engine.kv_layout, engine.state_layout
    itemsize = torch.empty((), dtype=kv.dtype).element_size()
    attn_bytes_per_token = 2 * kv.n_kv_heads * kv.head_dim * itemsize  # K + V, one layer
    state_bytes = st.slot_bytes // st.num_layers  # conv + ssm, one sequence, one layer
    blocks_of_16 = -(-state_bytes // (KERNEL_BLOCK * attn_bytes_per_token))
    return {
        "block_size": KERNEL_BLOCK * blocks_of_16,
        "mamba_state_bytes_per_layer": state_bytes,
        "attention_bytes_per_token_per_layer": attn_bytes_per_token,
        "rule": "smallest multiple of 16 with block_size * attention_bytes_per_token_per_layer >= "
        "mamba_state_bytes_per_layer (vLLM HybridAttentionMambaModelConfig)",
    }


# -- engines ------------------------------------------------------------------------------------
def engine_config(model_dir: Path, block_size: int) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        num_threads=THREADS,
        # A few sequences only: one conversation is in flight; keeps the Mamba slot pool small.
        scheduler=SchedulerConfig(max_num_seqs=4),
        cache=CacheConfig(block_size=block_size, kv_cache_bytes=128 << 20, mamba_align_tokens=block_size),
    )


def warm_up(engine: LLMEngine) -> None:
    rng = random.Random(1)
    ids = [rng.randrange(8, 100) for _ in range(200)]
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


@dataclass
class Timing:
    ttft_s: float
    total_s: float
    ttft_cpu_s: float
    submit_s: float  # time inside begin_turn / add_request (prompt building, validation)
    steps: int


def probe_ttft(engine: LLMEngine, request_id: str, submit) -> float:
    """One extra TTFT sample: submit, step to the first token, abort (the turn is discarded,
    the committed head is untouched)."""
    gc.collect()
    t0 = time.perf_counter()
    submit()
    while True:
        outs = engine.step()
        mine = [o for o in outs if o.request_id == request_id]
        if any(o.error for o in mine):
            raise RuntimeError(f"{request_id}: {mine[0].error}")
        if any(o.new_tokens for o in mine):
            ttft = time.perf_counter() - t0
            break
    engine.abort(request_id)
    assert not engine.has_unfinished()
    return ttft


def drive(engine: LLMEngine, request_id: str, submit) -> tuple[Timing, object]:
    """Submit, then step the engine synchronously until the request finishes."""
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    request = submit()
    t_sub = time.perf_counter()
    first = first_cpu = None
    steps = 0
    done = False
    while not done:
        outs = engine.step()
        steps += 1
        for out in outs:
            if out.request_id != request_id:
                continue
            if out.error:
                raise RuntimeError(f"{request_id}: {out.error}")
            if first is None and out.new_tokens:
                first, first_cpu = time.perf_counter(), time.process_time()
            done = done or out.finished
        if not outs and not engine.has_unfinished():
            raise RuntimeError(f"{request_id}: the engine went idle before the request finished")
    end = time.perf_counter()
    return Timing(first - t0, end - t0, first_cpu - c0, t_sub - t0, steps), request


def cut_to_aligned(cache: ConversationCache, conversation_id: str, turn: int, block: int) -> dict:
    """Make the committed head what align mode keeps: KV up to the last full block and the
    Mamba state at that block boundary (copied into the head's terminal slot)."""
    key = conversation_key(conversation_id, SALT)
    head = next(h for h in cache.heads.of_conversation(key) if h.turn == turn)
    committed = head.state_len
    aligned = head.aligned_len
    assert aligned == committed // block * block, (aligned, committed, block)
    terminal, snapshot = cache.states.slots[head.holder]
    if aligned != committed:
        cache.engine.runner.copy_slots([(snapshot, terminal)])
    cache.kv.truncate(head.holder, aligned)
    head.state_len = aligned
    return {"committed": committed, "aligned": aligned}


def turn_prompt(cache: ConversationCache, conversation_id: str, suffix: list[dict]) -> list[int]:
    """The full prompt ids begin_turn builds for the next turn (ledger ids + template delta)."""
    conv = cache.conversations.get(conversation_key(conversation_id, SALT))
    if conv is None:
        return build_turn_prompt(cache.engine.tokenizer, [], [], suffix).token_ids
    return build_turn_prompt(cache.engine.tokenizer, conv.tokens_until(conv.turn), conv.messages, suffix).token_ids


def finish_mode(rec: dict, mode: str, timing: Timing, req, samples: list[float], prompts: dict) -> None:
    prompts[mode] = list(req.prompt_token_ids)
    rec[mode] = asdict(timing) | {
        "ttft_first_run_s": timing.ttft_s,
        "ttft_s": min(samples),  # min of the probes and the real turn (noise only adds time)
        "ttft_median_s": statistics.median(samples),
        "ttft_samples_s": list(samples),
        "prompt_tokens": req.num_prompt_tokens,
        "reused_tokens": req.num_cached_tokens,
        "computed_prompt_tokens": req.num_prompt_tokens - req.num_cached_tokens,
        "output_token_ids": req.output_token_ids,
    }


# -- transformers ---------------------------------------------------------------------------------
class HFRunner:
    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.GenerationConfig = GenerationConfig

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[float, list[int]]:
        config = self.GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,  # ignore_eos, like the engine runs
            pad_token_id=PAD_TOKEN_ID,
            suppress_tokens=list(NEVER_SAMPLE_TOKEN_IDS),  # the engine never samples these either
        )
        ids = torch.tensor([prompt])
        gc.collect()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return time.perf_counter() - t0, out[0, len(prompt) :].tolist()


# -- the run ----------------------------------------------------------------------------------------
def run(plan: Plan, quick: bool) -> dict:
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()
    wall0 = time.perf_counter()
    scripts = make_scripts(plan)
    with tempfile.TemporaryDirectory(prefix="bench-conversation-") as tmp:
        model_dir = make_model(Path(tmp) / "bamba-bench", "bamba", "bench", seed=0)
        engine_a = LLMEngine(engine_config(model_dir, 16))
        block = vllm_hybrid_block_size(engine_a)
        B = block["block_size"]
        engines = {
            "a": engine_a,
            "b": LLMEngine(engine_config(model_dir, B)),
            "b16": LLMEngine(engine_config(model_dir, 16)),
            "c": LLMEngine(engine_config(model_dir, 16)),
        }
        caches = {m: ConversationCache(engines[m]) for m in ("a", "b", "b16")}
        aligned_block = {"b": B, "b16": 16}
        for engine in engines.values():
            warm_up(engine)
        hf = HFRunner(model_dir) if plan.hf_turns else None
        if hf is not None:
            hf.generate(list(range(8, 72)), 2)  # warm-up
        model_params = sum(p.numel() for p in engines["a"].model.parameters())
        kv_layouts = {m: asdict(e.kv_layout) | {"dtype": str(e.kv_layout.dtype)} for m, e in engines.items()}
        state_layout = asdict(engines["a"].state_layout) | {"dtype": str(engines["a"].state_layout.dtype)}
        setup_s = time.perf_counter() - wall0

        records: list[list[dict]] = []
        mismatches: list[str] = []
        for ci, script in enumerate(scripts):
            conv_records = []
            cid = f"conv-{ci}"
            for t in range(plan.turns):
                params = SamplingParams(temperature=0, max_tokens=script.replies[t], ignore_eos=True)
                rec: dict = {"turn": t + 1, "max_tokens": script.replies[t]}
                order = ENGINE_MODES[t % 4 :] + ENGINE_MODES[: t % 4]
                rec["order"] = list(order)
                # (c)'s prompt: what begin_turn will build for (a) (checked against it below).
                prompt_c = turn_prompt(caches["a"], cid, suffix_of(script, t))
                prompts: dict[str, list[int]] = {}
                samples: dict[str, list[float]] = {m: [] for m in ENGINE_MODES}
                # Extra TTFT samples (contention on a shared 2-core machine is noisy): all modes
                # in the rotated order, PROBES times, then the real turn of each mode.
                for rep in range(PROBES + 1):
                    for mode in order:
                        rid = f"{mode}-{ci}-{t + 1}" + ("" if rep == PROBES else f"-probe{rep}")
                        engine = engines[mode]
                        if mode == "c":
                            submit = lambda e=engine, r=rid: e.add_request(r, prompt_c, params)  # noqa: E731
                        else:
                            submit = lambda c=caches[mode], r=rid, s=suffix_of(script, t): c.begin_turn(  # noqa: E731
                                cid, SALT, s, params, r
                            )
                        if rep < PROBES:
                            samples[mode].append(probe_ttft(engine, rid, submit))
                            continue
                        timing, req = drive(engine, rid, submit)
                        samples[mode].append(timing.ttft_s)
                        finish_mode(rec, mode, timing, req, samples[mode], prompts)
                        if mode in aligned_block:
                            rec[mode]["head"] = cut_to_aligned(caches[mode], cid, t + 1, aligned_block[mode])
                out_a = rec["a"]["output_token_ids"]
                rec["history_tokens"] = rec["a"]["prompt_tokens"]
                rec["eos_in_reply_a"] = out_a.count(EOS_TOKEN_ID)  # ignore_eos: the reply may contain it
                rec["a_equals_c"] = out_a == rec["c"]["output_token_ids"]
                rec["b_equals_a"] = out_a == rec["b"]["output_token_ids"]
                rec["b16_equals_a"] = out_a == rec["b16"]["output_token_ids"]
                rec["prompts_equal"] = all(prompts[m] == prompts["a"] for m in prompts)
                if prompts["c"] != prompts["a"]:
                    mismatches.append(f"conversation {ci} turn {t + 1}: (c) prompt != (a) prompt")
                if not rec["a_equals_c"]:
                    mismatches.append(f"conversation {ci} turn {t + 1}: (a) tokens != (c) tokens")
                if ci == 0 and hf is not None and t + 1 in plan.hf_turns:
                    ttft_d, first_d = hf.generate(prompts["a"], 1)
                    total_d, out_d = hf.generate(prompts["a"], script.replies[t])
                    rec["d"] = {
                        "ttft_s": ttft_d,
                        "total_s": total_d,
                        "output_token_ids": out_d,
                        "output_len_ok": len(out_d) == script.replies[t],
                    }
                    rec["d_equals_a"] = out_d == out_a
                    rec["d_first_equals_a"] = first_d[:1] == out_a[:1]
                conv_records.append(rec)
                line = "  ".join(f"{m}={rec[m]['ttft_s'] * 1e3:8.1f}ms" for m in (*ENGINE_MODES, "d") if m in rec)
                print(
                    f"conv {ci} turn {t + 1:2d} history {rec['history_tokens']:5d}  TTFT {line}  "
                    f"a==c {rec['a_equals_c']}",
                    flush=True,
                )
            records.append(conv_records)
        cache_stats = {m: c.stats() for m, c in caches.items()}
        for engine in engines.values():
            engine.check_integrity()

    return summarize(plan, quick, records, mismatches, block, cache_stats, {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "platform": platform.platform(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "setup_s": setup_s,
        "wall_s": time.perf_counter() - wall0,
    }, {
        "arch": "bamba",
        "preset": "bench",
        "parameters": model_params,
        "kv_layouts": kv_layouts,
        "state_layout": state_layout,
        "state_bytes_per_sequence": engines["a"].state_layout.slot_bytes,
    })


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(plan, quick, records, mismatches, block, cache_stats, env, model) -> dict:
    turns = plan.turns
    per_turn: dict[str, dict[str, list]] = {}
    for mode in ENGINE_MODES:
        per_turn[mode] = {
            "ttft_s": [_median([conv[t][mode]["ttft_s"] for conv in records]) for t in range(turns)],
            "total_s": [_median([conv[t][mode]["total_s"] for conv in records]) for t in range(turns)],
            "ttft_median_s": [_median([conv[t][mode]["ttft_median_s"] for conv in records]) for t in range(turns)],
            "ttft_cpu_s": [_median([conv[t][mode]["ttft_cpu_s"] for conv in records]) for t in range(turns)],
            "computed_prompt_tokens": [records[0][t][mode]["computed_prompt_tokens"] for t in range(turns)],
            "reused_tokens": [records[0][t][mode]["reused_tokens"] for t in range(turns)],
        }
    per_turn["d"] = {
        "turns": [t + 1 for t in range(turns) if "d" in records[0][t]],
        "ttft_s": [records[0][t]["d"]["ttft_s"] if "d" in records[0][t] else None for t in range(turns)],
        "total_s": [records[0][t]["d"]["total_s"] if "d" in records[0][t] else None for t in range(turns)],
    }
    history = [records[0][t]["history_tokens"] for t in range(turns)]
    a, b, c = per_turn["a"]["ttft_s"], per_turn["b"]["ttft_s"], per_turn["c"]["ttft_s"]
    ratio_last = c[-1] / a[-1]
    # Turn 1 has no history: every mode computes the same prompt from scratch.
    a_below_b = [a[t] < b[t] for t in range(1, turns)]
    all_a_eq_c = all(r["a_equals_c"] for conv in records for r in conv)
    return {
        "mode": "quick" if quick else "full",
        "plan": asdict(plan),
        "labels": {k: v.format(B=block["block_size"]) for k, v in LABELS.items()},
        "block_sizes": {"a": 16, "b": block["block_size"], "b16": 16, "c": 16, "vllm_hybrid": block},
        "history_tokens": history,
        "ttft_ratio_recompute_over_cached": ratio_last,
        "ttft_ratio_recompute_over_cached_median_samples": per_turn["c"]["ttft_median_s"][-1]
        / per_turn["a"]["ttft_median_s"][-1],
        "ttft_ratio_aligned_over_cached_last_turn": b[-1] / a[-1],
        "ttft_ratio_b16_over_cached_last_turn": per_turn["b16"]["ttft_s"][-1] / a[-1],
        "targets": {
            "last_turn_ttft_20x_below_recompute": ratio_last >= 20,
            "ttft_below_aligned_every_turn_from_2": all(a_below_b),
            "ttft_below_aligned_per_turn_from_2": a_below_b,
        },
        "correctness": {
            "a_equals_c_every_turn": all_a_eq_c,
            "mismatches": mismatches,
            "b_equals_a": [r["b_equals_a"] for r in records[0]],
            "b16_equals_a": [r["b16_equals_a"] for r in records[0]],
            "d_equals_a": {r["turn"]: r["d_equals_a"] for r in records[0] if "d" in r},
            "d_first_token_equals_a": {r["turn"]: r["d_first_equals_a"] for r in records[0] if "d" in r},
            "d_output_len_ok": {r["turn"]: r["d"]["output_len_ok"] for r in records[0] if "d" in r},
        },
        "per_turn": per_turn,
        "cache_stats": cache_stats,
        "env": env,
        "model": model,
        "method": __doc__,
        "records": records,
    }


# -- outputs --------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "—" if x is None else (f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:.1f}")


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def markdown(res: dict) -> str:
    pt, hist = res["per_turn"], res["history_tokens"]
    B = res["block_sizes"]["b"]
    vb = res["block_sizes"]["vllm_hybrid"]
    plan = res["plan"]
    lines = [
        f"# Conversation cache benchmark ({res['mode']})",
        "",
        f"Bamba `bench` checkpoint ({res['model']['parameters'] / 1e6:.1f}M parameters, random weights), "
        f"{plan['conversations']} conversation(s) x {plan['turns']} turns, system prompt ~{plan['system_tokens']} "
        f"tokens, user turns {plan['user_tokens'][0]}-{plan['user_tokens'][1]} tokens, greedy replies of "
        f"{plan['reply_tokens'][0]}-{plan['reply_tokens'][1]} tokens (ignore_eos). CPU, {res['env']['torch_threads']} "
        f"threads, fp32. Load average before/after: {res['env']['load_avg_before'][0]:.1f} / "
        f"{res['env']['load_avg_after'][0]:.1f} (on {res['env']['cpus']} CPUs).",
        "",
        f"- (a) exact conversation cache (block 16); (b) block-aligned reuse as vLLM align mode, B = **{B}** "
        f"(Mamba state {vb['mamba_state_bytes_per_layer']:,} B/layer, attention "
        f"{vb['attention_bytes_per_token_per_layer']} B/token/layer); (b16) the same with B = 16; "
        "(c) no reuse; (d) transformers generate (subset of turns).",
        f"- TTFT recompute/cached at the last turn: **{res['ttft_ratio_recompute_over_cached']:.1f}x** "
        f"(target >= 20x: {'met' if res['targets']['last_turn_ttft_20x_below_recompute'] else 'NOT met'}); "
        f"(a) below (b) on every turn >= 2: "
        f"{'yes' if res['targets']['ttft_below_aligned_every_turn_from_2'] else 'NO'}.",
        f"- Correctness: (a) tokens == (c) tokens on every turn: "
        f"{'yes' if res['correctness']['a_equals_c_every_turn'] else 'NO'}; "
        f"(b) == (a): {sum(res['correctness']['b_equals_a'])}/{plan['turns']} turns; "
        f"(b16) == (a): {sum(res['correctness']['b16_equals_a'])}/{plan['turns']}; "
        f"(d) == (a): {res['correctness']['d_equals_a']}.",
        "",
        "## TTFT (ms, min of 4 samples per mode and turn)",
        "",
        "| turn | history tokens | recomputed a / b / b16 / c | TTFT a | TTFT b | TTFT b16 | TTFT c | TTFT d "
        "| c/a | b/a | b16/a | d/a |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in range(len(hist)):
        a, b, b16, c = (pt[m]["ttft_s"][t] for m in ("a", "b", "b16", "c"))
        d = pt["d"]["ttft_s"][t]
        comp = " / ".join(str(pt[m]["computed_prompt_tokens"][t]) for m in ("a", "b", "b16", "c"))
        lines.append(
            f"| {t + 1} | {hist[t]} | {comp} | {_ms(a)} | {_ms(b)} | {_ms(b16)} | {_ms(c)} | {_ms(d)} "
            f"| {c / a:.1f} | {b / a:.1f} | {b16 / a:.2f} | {'—' if d is None else f'{d / a:.1f}'} |"
        )
    lines += [
        "",
        "## TTFT (ms, median of the same 4 samples)",
        "",
        "| turn | history tokens | a | b | b16 | c | c/a | b/a |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in range(len(hist)):
        a, b, b16, c = (pt[m]["ttft_median_s"][t] for m in ("a", "b", "b16", "c"))
        lines.append(
            f"| {t + 1} | {hist[t]} | {_ms(a)} | {_ms(b)} | {_ms(b16)} | {_ms(c)} | {c / a:.1f} | {b / a:.1f} |"
        )
    lines += [
        "",
        "## Total time per turn (s, prefill + all reply tokens; one sample: the real turn)",
        "",
        "| turn | history tokens | reply tokens | a | b | b16 | c | d |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in range(len(hist)):
        lines.append(
            f"| {t + 1} | {hist[t]} | {res['records'][0][t]['max_tokens']} | "
            + " | ".join(_s(pt[m]["total_s"][t]) for m in ("a", "b", "b16", "c", "d"))
            + " |"
        )
    lines += [
        "",
        "## Method",
        "",
        "TTFT: wall time from submitting the request (begin_turn / add_request, prompt building "
        "included) to the end of the first engine step that returns a token for it; one "
        "conversation in flight, the engine stepped synchronously; the order of the modes rotates "
        "per turn; TTFT is the minimum (and, second table, the median) of 4 samples "
        "(3 probe requests aborted after their first token, then the real turn), total time is "
        "the real turn. Replies are exactly max_tokens long (ignore_eos). (b): separate engine with CacheConfig(block_size=B, mamba_align_tokens=B) and "
        "its own ConversationCache; after each turn the committed head is cut back to what "
        "align mode keeps (KV up to the last full block, Mamba state at that boundary, taken by "
        "the engine's aligned snapshot during the forward), so the next turn recomputes "
        "[aligned_len, committed) plus the suffix. (c): plain add_request of (a)'s prompt ids "
        "(no prompt building in the timing). (d): transformers generate on the same ids, TTFT = "
        "a max_new_tokens=1 generate; only turns "
        f"{pt['d']['turns']} of conversation 0. Per-turn values are medians over conversations. "
        "CPU times and raw per-conversation records are in conversation.json.",
        "",
    ]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pt = res["per_turn"]
    turns = list(range(1, len(res["history_tokens"]) + 1))
    fig, ax = plt.subplots(figsize=(8, 5))
    style = {"a": ("o-", "C0"), "b": ("s-", "C1"), "b16": ("^--", "C2"), "c": ("x-", "C3")}
    for mode, (fmt, color) in style.items():
        ax.plot(turns, [v * 1e3 for v in pt[mode]["ttft_s"]], fmt, color=color, label=res["labels"][mode])
    d_turns = pt["d"]["turns"]
    if d_turns:
        ax.plot(d_turns, [pt["d"]["ttft_s"][t - 1] * 1e3 for t in d_turns], "D:", color="C4", label=res["labels"]["d"])
    ax.set_yscale("log")
    ax.set_xlabel("turn (history tokens below)")
    ax.set_xticks(turns)
    ax.set_xticklabels([f"{t}\n{h}" for t, h in zip(turns, res["history_tokens"])], fontsize=7)
    ax.set_ylabel("TTFT (ms, min of 4 samples; log scale)")
    ax.set_title(
        f"TTFT per turn — bamba bench, CPU {res['env']['torch_threads']} threads "
        f"(last turn: recompute/cached = {res['ttft_ratio_recompute_over_cached']:.0f}x)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (fewer turns, shorter lengths)")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    res = run(plan, args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "conversation.quick" if args.quick else "conversation"
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(res))
    plot(res, RESULTS / f"{stem}.png")
    print(markdown(res))
    if not res["correctness"]["a_equals_c_every_turn"]:
        print("FAIL: (a) and (c) disagree:", res["correctness"]["mismatches"], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
