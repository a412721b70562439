"""The engine benchmark's plans and runs: every side at every concurrency, alternated."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from bench.engine.int8_accuracy import logit_error
from bench.engine.plan import Plan
from bench.engine.sides import OursRunner, Run, Side, TransformersRunner, VllmRunner, make_prompts
from bench.engine.summary import _prefill_forward, summarize
from bench.kit.peer import vllm_runs
from bench.kit.roofline import host_speed, roofline
from workers.cache.layout import layouts_for
from workers.checkpoint import Arch, Preset, preset_shape
from workers.config import WeightQuantization
from workers.model.loader import read_model_config


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
