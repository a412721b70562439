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

Writes bench/results/conversation.{json,md,png} (the quick run: conversation.quick.*; --smoke,
the tiny checkpoint in seconds, conversation.smoke.*; --results-dir elsewhere).
"""

from __future__ import annotations

import argparse
import gc
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

from bench.common import chat_text, cpu_info, write_results
from bench.conversation_report import ENGINE_MODES, markdown, plot, summarize
from bench.conversation_vllm import VllmTurns, recheck_prefix_caching
from bench.peer import vllm_runs
from proto.contract import ConversationRef
from workers.checkpoint import Arch, make_model
from workers.checkpoint.tokens import EOS_TOKEN_ID, NEVER_SAMPLE_TOKEN_IDS, PAD_TOKEN_ID
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.conversation.cache import ConversationCache
from workers.conversation.prompt import build_turn_prompt
from workers.engine import LLMEngine
from workers.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
THREADS = 2
PROBES = 3  # extra TTFT samples per mode and turn (TTFT = min of PROBES + 1; median kept too)
VLLM_MAX_MODEL_LEN = 4096
RECHECK_HISTORY = 1600  # tokens: more than two of vLLM's hybrid blocks (640 on the bench models)
KERNEL_BLOCK = 16  # vLLM rounds the hybrid attention block size to a multiple of this
SALT = "bench"

@dataclass(frozen=True)
class Plan:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    hf_turns: tuple[int, ...]  # 1-based turns of conversation 0 measured with transformers
    seed: int = 0
    preset: str = "bench"


# Sized for ~10 minutes on 2 idle cores (decode of the replies, 4 modes, dominates).
FULL = Plan(conversations=1, turns=12, system_tokens=800, user_tokens=(80, 100), reply_tokens=(48, 52), hf_turns=(1, 6, 12))
QUICK = Plan(conversations=1, turns=3, system_tokens=300, user_tokens=(60, 80), reply_tokens=(8, 12), hf_turns=(3,))
# Proves the benchmark runs (CI, tests/bench): the tiny checkpoint, seconds; measures nothing.
SMOKE = Plan(conversations=1, turns=2, system_tokens=60, user_tokens=(10, 16), reply_tokens=(2, 3), hf_turns=(2,),
             preset="tiny")


# -- workload ---------------------------------------------------------------------------------
@dataclass
class Script:
    system: str
    users: list[str]
    replies: list[int]  # max_tokens per turn


def make_scripts(plan: Plan) -> list[Script]:
    rng = random.Random(plan.seed)
    scripts = []
    for c in range(plan.conversations):
        system = chat_text(rng, plan.system_tokens, f"You are assistant #{c}. Answer carefully.")
        users = [chat_text(rng, rng.randint(*plan.user_tokens), f"Question {t + 1}:") for t in range(plan.turns)]
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
    head = cache.head_of(ConversationRef(conversation_id, SALT), turn)
    committed = head.state_len
    aligned = head.aligned_len
    assert aligned == committed // block * block, (aligned, committed, block)
    caches = cache.engine.caches
    terminal, snapshot = caches.states.slots[head.holder]
    if aligned != committed:
        cache.engine.runner.copy_slots([(snapshot, terminal)])
    caches.kv.truncate(head.holder, aligned)
    caches.heads.unname(head)  # it no longer covers the tokens it was named by
    head.state_len = aligned
    return {"committed": committed, "aligned": aligned}


def turn_prompt(cache: ConversationCache, conversation_id: str, suffix: list[dict]) -> list[int]:
    """The full prompt ids begin_turn builds for the next turn (ledger ids + template delta)."""
    conv = cache.ledger(ConversationRef(conversation_id, SALT))
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
def run(plan: Plan, quick: bool, arch: Arch, with_vllm: bool) -> dict:
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()
    wall0 = time.perf_counter()
    scripts = make_scripts(plan)
    with tempfile.TemporaryDirectory(prefix="bench-conversation-") as tmp:
        model_dir = make_model(Path(tmp) / f"{arch.value}-{plan.preset}", arch, plan.preset, seed=0)
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
        vllm = VllmTurns(model_dir, THREADS, max_model_len=VLLM_MAX_MODEL_LEN) if with_vllm and vllm_runs(arch) else None
        if vllm is not None:
            vllm.warm_up([8 + i % 90 for i in range(200)])  # ordinary ids of the built-in vocabulary
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
                modes = ENGINE_MODES + (("v",) if vllm is not None else ())
                order = modes[t % len(modes) :] + modes[: t % len(modes)]
                rec["order"] = list(order)
                # (c)'s prompt: what begin_turn will build for (a) (checked against it below).
                prompt_c = turn_prompt(caches["a"], cid, suffix_of(script, t))
                prompts: dict[str, list[int]] = {}
                samples: dict[str, list[float]] = {m: [] for m in modes}
                # Extra TTFT samples (contention on a shared 2-core machine is noisy): all modes
                # in the rotated order, PROBES times, then the real turn of each mode.
                for rep in range(PROBES + 1):
                    for mode in order:
                        if mode == "v":  # vLLM-CPU: the same full prompt ids as (c), no reuse
                            if rep < PROBES:
                                samples["v"].append(vllm.probe_ttft(prompt_c))
                            else:
                                rec["v"] = vllm.turn(prompt_c, script.replies[t])
                                samples["v"].append(rec["v"]["ttft_s"])
                                rec["v"] |= {"ttft_first_run_s": rec["v"]["ttft_s"], "ttft_s": min(samples["v"]),
                                             "ttft_median_s": statistics.median(samples["v"]),
                                             "ttft_samples_s": list(samples["v"])}  # fmt: skip
                            continue
                        rid = f"{mode}-{ci}-{t + 1}" + ("" if rep == PROBES else f"-probe{rep}")
                        engine = engines[mode]
                        if mode == "c":
                            submit = lambda e=engine, r=rid: e.add_request(r, prompt_c, params)  # noqa: E731
                        else:
                            submit = lambda c=caches[mode], r=rid, s=suffix_of(script, t): c.begin_turn(  # noqa: E731
                                ConversationRef(cid, SALT), s, params, r
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
                if "v" in rec:
                    rec["v_equals_a"] = rec["v"]["output_token_ids"] == out_a
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
                line = "  ".join(f"{m}={rec[m]['ttft_s'] * 1e3:8.1f}ms" for m in (*ENGINE_MODES, "d", "v") if m in rec)
                print(
                    f"conv {ci} turn {t + 1:2d} history {rec['history_tokens']:5d}  TTFT {line}  "
                    f"a==c {rec['a_equals_c']}",
                    flush=True,
                )
            records.append(conv_records)
        cache_stats = {m: c.stats() for m, c in caches.items()}
        vllm_info = None
        if vllm is not None:
            vllm_info = vllm.info | {"settings_note": "prefix caching off: see prefix_caching_recheck"}
            vllm.close()
            # The last turn's prompt, repeated past vLLM's hybrid block size (the crash needs that).
            history = (prompts["a"] * (1 + RECHECK_HISTORY // len(prompts["a"])))[:RECHECK_HISTORY]
            vllm_info["prefix_caching_recheck"] = recheck_prefix_caching(
                model_dir, THREADS, history, [20 + i % 70 for i in range(plan.user_tokens[0])]
            )
        for engine in engines.values():
            engine.check_integrity()

    return summarize(plan, quick, records, mismatches, block, cache_stats, {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "platform": platform.platform(),
        "cpu": cpu_info(),
        "vllm": vllm_info,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "setup_s": setup_s,
        "wall_s": time.perf_counter() - wall0,
    }, {
        "arch": arch.value,
        "preset": plan.preset,
        "parameters": model_params,
        "kv_layouts": kv_layouts,
        "state_layout": state_layout,
        "state_bytes_per_sequence": engines["a"].state_layout.slot_bytes,
    }, __doc__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (fewer turns, shorter lengths)")
    parser.add_argument("--arch", type=Arch, choices=list(Arch), default=Arch.GRANITEMOEHYBRID)
    parser.add_argument("--no-vllm", action="store_true", help="leave the vLLM-CPU mode (v) out")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 short turns: proves it runs, measures nothing")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    # The smoke's tiny checkpoint has 16-wide attention heads, which vLLM-CPU's attention refuses
    # ("Unsupported CPU attention configuration: head_dim=16"): the smoke leaves vLLM out.
    res = run(plan, args.quick or args.smoke, args.arch, not (args.no_vllm or args.smoke))
    stem = "conversation.smoke" if args.smoke else "conversation.quick" if args.quick else "conversation"
    write_results(stem, res, markdown(res), args.results_dir)
    plot(res, args.results_dir / f"{stem}.png")
    print(markdown(res))
    if not res["correctness"]["a_equals_c_every_turn"]:
        print("FAIL: (a) and (c) disagree:", res["correctness"]["mismatches"], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

