"""Every weight dtype the engine accepts runs prefill and decode and stays close to fp32.

The engine is run in bf16 / fp16 on a prompt long enough to span several Mamba chunks and
KV blocks, then decodes greedily; the logits it sampled from are compared with the fp32
logits of the very same token sequence (teacher-forced), scaled by their std. The allowed
error is what the dtype costs the reference itself: `transformers` loaded in that dtype, on
the same sequence, is off from fp32 by some amount (0.08-0.17 for bf16 on these tiny random
models, ~0.01-0.02 for fp16); ours may be off by at most 1.5 times that. Mamba states stay
fp32 whatever the weights. A dtype the engine cannot run is refused when the config is made.
"""

from __future__ import annotations

import pytest
import torch

from transformers import AutoModelForCausalLM

from tests.engine.conftest import GREEDY, LogitRecorder, hf_logits, new_engine, our_logits, prompt_of, run_engine
from workers.checkpoint import Arch
from workers.config import EngineConfig

HALF_DTYPES = [torch.bfloat16, torch.float16]
SLACK = 1.5  # ours may be off from fp32 by this times what transformers in the same dtype is


@pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_dtypes_match_fp32(tiny, arch, dtype):
    ckpt = tiny[arch]
    engine = new_engine(ckpt.path, dtype=dtype)
    recorder = LogitRecorder(engine)
    prompt = prompt_of(40, seed=2)
    run = run_engine(engine, [prompt])
    assert len(run.tokens["r0"]) == GREEDY.max_tokens
    ours = recorder.stacked("r0").float()
    ids = prompt + run.tokens["r0"][:-1]
    ref = our_logits(ckpt.ours, ids)[len(prompt) - 1 :]
    hf_ref = hf_logits(ckpt, ids)[len(prompt) - 1 :]
    hf_half = AutoModelForCausalLM.from_pretrained(ckpt.path, local_files_only=True, dtype=dtype).eval()
    with torch.no_grad():
        hf_same_dtype = hf_half(torch.tensor([ids]), use_cache=False).logits[0, len(prompt) - 1 :].float()
    allowed = SLACK * _scaled_error(hf_same_dtype, hf_ref)
    assert _scaled_error(ours, ref) <= allowed, (dtype, _scaled_error(ours, ref), allowed)
    assert engine.runner.caches.ssm[0].dtype == torch.float32


def _scaled_error(logits: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((logits - ref) / ref.std()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_unsupported_dtype_is_refused_at_startup(tiny, dtype):
    with pytest.raises(ValueError, match="dtype.*float32.*bfloat16.*float16"):
        EngineConfig(model=str(tiny[Arch.BAMBA].path), dtype=dtype)
