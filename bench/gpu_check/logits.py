"""Our logits == transformers' on the same device, per model, in fp32 and in bf16.

Our side runs the prompt through the engine's runner as a prefill of all but the last three
tokens, then three one-token decode steps (the device's prefill and decode paths both);
transformers runs one full-sequence forward. The error is max |ours - ref| / std(ref) over
every position.

    fp32   ours vs transformers fp32:                       <= 1e-4
    bf16   ours bf16 vs transformers fp32 <= 1.5 x (transformers bf16 vs transformers fp32)
           (what bf16 costs the reference itself, the bound of tests/engine/test_dtypes.py)
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.cache.layout import layouts_for
from workers.checkpoint.tokens import ORDINARY_TOKEN_IDS
from workers.model.loader import load_model
from workers.request import Request
from workers.runner import ModelRunner
from workers.sampling import SamplingParams
from workers.scheduler import ScheduledChunk

FP32_TOL = 1e-4
BF16_SLACK = 1.5
DECODE_STEPS = 3


def prompt_ids(length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(ORDINARY_TOKEN_IDS.start, ORDINARY_TOKEN_IDS.stop, (length,), generator=g).tolist()


@torch.no_grad()  # not inference mode: the runner packs weights for the CPU fast path here
def ours(model_dir: Path, ids: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    model = load_model(model_dir, dtype, str(device))
    block_size = 16
    n_blocks = -(-len(ids) // block_size)
    kv, state = layouts_for(model.config, n_blocks + 3, block_size, 3, dtype)
    runner = ModelRunner(model, kv, state, str(device))
    table = list(range(n_blocks + 2, 2, -1))  # reversed, so paging arithmetic is exercised
    request = Request("logits", list(ids), SamplingParams(temperature=0.0))
    out, start = [], 0
    for n in [len(ids) - DECODE_STEPS] + [1] * DECODE_STEPS:
        batch, _ = runner.build_batch([ScheduledChunk(request, start, n, table, state_slot=2)])
        out.append(model.compute_logits(model(batch, runner.caches)).float())
        start += n
    return torch.cat(out)


@torch.inference_mode()
def reference(model_dir: Path, ids: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype).to(device).eval()
    logits = model(torch.tensor([ids], device=device), use_cache=False).logits[0].float()
    del model
    return logits


def scaled_error(ours_logits: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((ours_logits - ref) / ref.std()).abs().max())


def check_model(name: str, model_dir: Path, prompt_len: int, device: torch.device) -> dict:
    ids = prompt_ids(prompt_len)
    ref32 = reference(model_dir, ids, torch.float32, device)
    fp32 = scaled_error(ours(model_dir, ids, torch.float32, device), ref32)
    hf_bf16 = scaled_error(reference(model_dir, ids, torch.bfloat16, device), ref32)
    bf16 = scaled_error(ours(model_dir, ids, torch.bfloat16, device), ref32)
    bound = BF16_SLACK * hf_bf16
    return {
        "model": name,
        "prompt_tokens": prompt_len,
        "fp32_error": fp32,
        "fp32_bound": FP32_TOL,
        "bf16_error": bf16,
        "bf16_transformers_error": hf_bf16,
        "bf16_bound": bound,
        "passed": fp32 <= FP32_TOL and bf16 <= bound,
    }
