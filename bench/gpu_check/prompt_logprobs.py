"""Prompt logprobs on the device (completions' `echo` with `logprobs`, lm-eval's log-likelihood)
== transformers' log_softmax of one full forward, in fp32.

The engine runs the prompt with `prompt_logprobs` in prefill chunks of `chunk` tokens (so the
LM head runs on rows of several steps); the error is max |ours - transformers| over every
prompt token after the first, and each entry names the prompt's own token.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.gpu_check.logits import FP32_TOL, prompt_ids, reference
from workers.config import EngineConfig, SchedulerConfig
from workers.engine import LLMEngine
from workers.sampling import SamplingParams


def check(model_dir: Path, device: torch.device, prompt_len: int, chunk: int) -> dict:
    ids = prompt_ids(prompt_len, seed=5)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=str(device), dtype=torch.float32,
                                    scheduler=SchedulerConfig(max_num_batched_tokens=chunk)))  # fmt: skip
    engine.add_request("prompt", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1))
    entries = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(out.error)
            entries = out.prompt_logprobs if out.prompt_logprobs is not None else entries
    expected = torch.log_softmax(reference(model_dir, ids, torch.float32, device), dim=-1)  # row p -> token p+1
    tokens_right = entries is not None and [e.token_id for e in entries] == ids
    error = max(abs(e.logprob - float(expected[p, ids[p + 1]])) for p, e in enumerate(entries[1:])) if entries else None
    return {"prompt_tokens": prompt_len, "chunk": chunk, "tokens_right": tokens_right, "max_error": error,
            "bound": FP32_TOL, "passed": tokens_right and error is not None and error <= FP32_TOL}
