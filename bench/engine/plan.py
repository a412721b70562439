"""The engine benchmark's plans and targets."""

from __future__ import annotations

from dataclasses import dataclass

from workers.config import SchedulerConfig


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
