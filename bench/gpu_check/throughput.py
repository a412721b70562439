"""Prefill and decode tokens/s, our engine against transformers' `generate`, in bf16 on the device.

Each side gets the same `c` random prompts of `prompt_len` tokens and makes `new_tokens` greedy
tokens each (EOS ignored). Three instants are cut on each side (after a device sync):

    t0 ── prefill ──> t_first ── decode ──> t_end
    prefill tokens/s = c * prompt_len / (t_first - t0)
    decode tokens/s  = tokens made after t_first / (t_end - t_first)

transformers runs left-padded batches with its own cache (`generate`, SDPA attention, the
torch path of its Mamba2 mixer when no mamba-ssm kernels are installed). One warm-up run per
side first (allocator, cuBLAS handles); one measured run per concurrency.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.gpu_check.logits import prompt_ids
from workers.checkpoint.tokens import PAD_TOKEN_ID
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine import LLMEngine
from workers.sampling import SamplingParams


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _rates(c: int, prompt_len: int, decoded: int, t0: float, first: float, end: float) -> dict:
    return {
        "concurrency": c,
        "prefill_s": first - t0,
        "decode_s": end - first,
        "prefill_tokens_per_s": c * prompt_len / (first - t0),
        "decode_tokens_per_s": decoded / (end - first) if end > first else None,
    }


class Ours:
    def __init__(self, model_dir: Path, device: torch.device, max_seqs: int, kv_bytes: int):
        self.device = device
        self.engine = LLMEngine(EngineConfig(
            model=str(model_dir), device=str(device), dtype=torch.bfloat16,
            scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8192),
            cache=CacheConfig(kv_cache_bytes=kv_bytes),
        ))  # fmt: skip
        self.runs = 0

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        ids = [f"speed-{self.runs}-{i}" for i in range(len(prompts))]
        self.runs += 1
        made = dict.fromkeys(ids, 0)
        t0 = _now(self.device)
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, prompt, params)
        first, before_first = None, 0
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error:
                    raise RuntimeError(out.error)
                made[out.request_id] += len(out.new_token_ids)
            if first is None and all(made.values()):
                first, before_first = _now(self.device), sum(made.values())
        end = _now(self.device)
        return _rates(len(prompts), len(prompts[0]), sum(made.values()) - before_first, t0, first, end)


class Transformers:
    def __init__(self, model_dir: Path, device: torch.device):
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.bfloat16)
        self.model = self.model.to(device).eval()

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        from transformers.generation.streamers import BaseStreamer

        device = self.device

        class FirstToken(BaseStreamer):
            def __init__(self) -> None:
                self.calls: list[float] = []

            def put(self, value) -> None:  # once with the prompt, then once per step
                self.calls.append(_now(device))

            def end(self) -> None:
                pass

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        clock = FirstToken()
        t0 = _now(device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  use_cache=True, pad_token_id=PAD_TOKEN_ID, eos_token_id=None, streamer=clock)
        end = _now(device)
        decoded = (out.shape[1] - width - 1) * len(prompts)
        return _rates(len(prompts), width, decoded, t0, clock.calls[1], end)


def measure(model_dir: Path, device: torch.device, concurrency: tuple[int, ...], prompt_len: int, new_tokens: int) -> dict:
    top = max(concurrency)
    kv_bytes = (8 << 30) if device.type == "cuda" else (256 << 20)
    sides = {"ours": Ours(model_dir, device, top, kv_bytes), "transformers": None}
    rows: list[dict] = []
    for name in ("ours", "transformers"):
        side = sides[name] or Transformers(model_dir, device)
        side.run([prompt_ids(prompt_len, seed=999)], 2)  # warm-up
        for c in concurrency:
            prompts = [prompt_ids(prompt_len, seed=1000 + i) for i in range(c)]
            rows.append({"side": name, **side.run(prompts, new_tokens)})
        del side
        sides[name] = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ratios = {}
    for c in concurrency:
        ours = next(r for r in rows if r["side"] == "ours" and r["concurrency"] == c)
        theirs = next(r for r in rows if r["side"] == "transformers" and r["concurrency"] == c)
        ratios[c] = {m: (ours[m] / theirs[m] if ours[m] and theirs[m] else None)
                     for m in ("prefill_tokens_per_s", "decode_tokens_per_s")}  # fmt: skip
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "runs": rows, "ours_over_transformers": ratios}
