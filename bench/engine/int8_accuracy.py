"""What weight-only int8 costs in accuracy: the model's logits at every prompt position on int8
panels against the same model on its fp32 weights (the fast path either way), teacher-forced,
so the comparison never drifts onto different tokens. The int8 mode runs prompts (batches of
more than `INT8_MAX_ROWS` rows) on the fp32 weights; here every row runs on int8, the error
each generated token sees.

    max_abs_logit_error      max |int8 - fp32| over all positions and the vocabulary
    max_scaled_logit_error   the same divided by the fp32 logits' standard deviation
    top1_agreement           share of positions whose argmax (the greedy next token) is equal

The free-running greedy agreement of whole sequences is the engine benchmark's
`agreement_with_ours` for the `ours-int8` side.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.cache.layout import layouts_for
from workers.config import WeightQuantization
from workers.kernels.linear_plan import int8_plan
from workers.kernels.linear_tuning import tune_linears
from workers.model.loader import load_model
from workers.request import Request
from workers.runner import ModelRunner
from workers.sampling import SamplingParams
from workers.scheduler import ScheduledChunk

_BLOCK = 16
_SLOT = 0


@torch.inference_mode()
def _prompt_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt run as a single prefill from a zero state."""
    for conv, ssm in zip(runner.caches.conv, runner.caches.ssm):
        conv[_SLOT] = 0
        ssm[_SLOT] = 0
    table = list(range(1, -(-len(ids) // _BLOCK) + 1))  # block 0 is the null block
    request = Request("int8-accuracy", list(ids), SamplingParams(max_tokens=1, temperature=0.0))
    batch, _ = runner.build_batch([ScheduledChunk(request, 0, len(ids), table, state_slot=_SLOT)])
    return runner.model.compute_logits(runner.model(batch, runner.caches)).float()


def logit_error(model_dir: Path, prompts: list[list[int]], threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    model = load_model(model_dir, torch.float32, "cpu")
    longest = max(len(p) for p in prompts)
    kv, state = layouts_for(model.config, -(-longest // _BLOCK) + 1, _BLOCK, 1, torch.float32)
    plans = {WeightQuantization.NONE: tune_linears(model.blocks), WeightQuantization.INT8: int8_plan(model.blocks, max_rows=None)}
    logits: dict[WeightQuantization, list[torch.Tensor]] = {}
    for mode, plan in plans.items():
        runner = ModelRunner(model, kv, state, "cpu", True, plan, weight_quantization=mode)
        try:
            logits[mode] = [_prompt_logits(runner, p) for p in prompts]
        finally:
            runner.set_fast_kernels(False)
    fp32, int8 = torch.cat(logits[WeightQuantization.NONE]), torch.cat(logits[WeightQuantization.INT8])
    error = (int8 - fp32).abs()
    return {
        "positions": fp32.shape[0],
        "max_abs_logit_error": float(error.max()),
        "max_scaled_logit_error": float(error.max() / fp32.std()),
        "top1_agreement": float((int8.argmax(-1) == fp32.argmax(-1)).float().mean()),
    }
