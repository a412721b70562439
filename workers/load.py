"""What a replica reports of its engine for routing: its queue and its measured speeds.

The router prices each request on each replica as queue + prefill it lacks, at the replica's own
speed (deployments/routing/cost.py); these are the figures it prices with.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest measurement: a replica's speed follows a change of load or batch mix
# within a few dozen steps, and one odd step moves it little.
EWMA_WEIGHT = 0.1
# A step with fewer prefill tokens than this measures per-step overhead, not prefill speed.
MIN_PREFILL_TOKENS = 16


@dataclass(frozen=True)
class EngineLoad:
    requests: int  # in the engine: waiting or running
    free_kv_blocks: int
    waiting_prefill_tokens: int = 0  # prompt tokens its requests have not computed yet
    prefill_tokens_per_s: float = 0.0  # 0: not measured yet
    mean_prefill_tokens: float = 0.0  # tokens a request computes once admitted (after what it attached); 0: not measured yet
    taken_at: float = 0.0  # wall time it describes (0: now); what the router sent after it is in no report
    kv_cache_usage: float = 0.0  # the fraction of KV blocks requests hold (vllm:kv_cache_usage_perc)


class Rate:
    """An exponentially weighted mean of amount / seconds, 0 until the first observation."""

    def __init__(self) -> None:
        self.value = 0.0

    def observe(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value == 0 else (1 - EWMA_WEIGHT) * self.value + EWMA_WEIGHT * rate


class Mean:
    """An exponentially weighted mean, 0 until the first observation."""

    def __init__(self) -> None:
        self.value = 0.0

    def observe(self, x: float) -> None:
        self.value = x if self.value == 0 else (1 - EWMA_WEIGHT) * self.value + EWMA_WEIGHT * x
