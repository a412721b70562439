"""Deterministic requests give the same bits alone and under concurrent load, on the device.

On a GPU the kernels' reduction order follows the batch shape far more than on a CPU, so this
is the property the deterministic mode exists for: each deterministic request (sampled, seeded,
with logprobs) runs alone, then again beside ordinary requests of other lengths that join and
leave around it; its tokens and logprobs must be bit-identical. bf16, the GPU's serving dtype.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from bench.gpu_check.conversation import drive, engine_on
from bench.gpu_check.logits import prompt_ids
from workers.engine import LLMEngine
from workers.sampling import SamplingParams


def _deterministic(i: int, tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=100 + i, max_tokens=tokens, ignore_eos=True, logprobs=0,
                          deterministic=True)  # fmt: skip


def _alone(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[dict]:
    out = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"alone-{i}", prompt, _deterministic(i, tokens))
        out.append(drive(engine)[f"alone-{i}"])
    return out


def _under_load(engine: LLMEngine, prompts: list[list[int]], tokens: int, load: int) -> list[dict]:
    rng = random.Random(7)
    for j in range(load // 2):  # some ordinary requests are running when the deterministic ones arrive
        engine.add_request(f"load-{j}", prompt_ids(rng.randint(8, 3 * len(prompts[0])), seed=50 + j),
                           SamplingParams(temperature=1.0, max_tokens=rng.randint(4, 2 * tokens), ignore_eos=True))
    for _ in range(2):
        engine.step()  # (the load's own tokens are not checked)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"det-{i}", prompt, _deterministic(i, tokens))
    for j in range(load // 2, load):  # and more join while they run
        engine.add_request(f"load-{j}", prompt_ids(rng.randint(8, 3 * len(prompts[0])), seed=50 + j),
                           SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 2 * tokens), ignore_eos=True))
    results = drive(engine)
    return [results[f"det-{i}"] for i in range(len(prompts))]


def check(name: str, model_dir: Path, device: torch.device, requests: int, load: int, tokens: int) -> dict:
    engine = engine_on(model_dir, device, torch.bfloat16)
    prompts = [prompt_ids(40 + 13 * i, seed=i) for i in range(requests)]
    alone = _alone(engine, prompts, tokens)
    loaded = _under_load(engine, prompts, tokens, load)
    same = [a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"] for a, b in zip(alone, loaded)]
    errors = [r["error"] for r in alone + loaded if r.get("error")]
    return {
        "model": name,
        "dtype": "bfloat16",
        "requests": requests,
        "load_requests": load,
        "tokens_each": tokens,
        "bit_identical": sum(same),
        "errors": errors,
        "passed": all(same) and not errors and all(len(r["tokens"]) == tokens for r in alone),
    }
