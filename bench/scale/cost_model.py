"""How long a simulated GPU replica takes for one turn: a fit to our measured H200 speeds.

Source: bench/results/gpu.md, "Throughput, bf16: granitemoehybrid bench preset scaled up
(912.6M parameters)", our engine at c = 32 concurrent requests (NVIDIA H200):

    prefill 37,212.5 tok/s  (all 32 together)  ->  per request slot  1,162.9 tok/s
    decode   1,195.3 tok/s  (all 32 together)  ->  per request slot     37.35 tok/s

A replica runs BATCH turns at once, each one taking

    turn_s = new_prompt_tokens / 1,162.9 + output_tokens / 37.35 (+ head import when the head moved)

Check against the same row: 512 prompt + 64 new tokens -> 0.440 + 1.714 = 2.15 s, measured
0.440 + 1.647 = 2.09 s. The measured GPU turn rate used for sizing is that row's: 32 turns per
2.087 s = 15.3 turns/s per replica (GPU_TURNS_PER_S); the simulated mix's own rate is
`mix_turns_per_s` (its turns are longer or shorter than the preset's).
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments.routing.cost import DEFAULT_IMPORT_SPEEDUP

SOURCE = "bench/results/gpu.md, granitemoehybrid bench preset (912.6M params, bf16), ours at c=32, NVIDIA H200"
BATCH = 32  # request slots per replica: the measured concurrency
PREFILL_TOKENS_PER_S = 37_212.5 / BATCH
DECODE_TOKENS_PER_S = 1_195.3 / BATCH
# The measured row's turn: 512-token prompts, 64 new tokens, prefill 0.440 s + decode 1.647 s.
GPU_TURNS_PER_S = BATCH / (0.440 + 1.647)
# A head import moves bytes: the router's own default ratio to prefill (routing/cost.py).
IMPORT_TOKENS_PER_S = PREFILL_TOKENS_PER_S * DEFAULT_IMPORT_SPEEDUP


@dataclass(frozen=True)
class TurnWork:
    """What one turn computes on its replica."""

    new_prompt_tokens: int  # the turn's new messages (the history is held as the head)
    output_tokens: int

    def seconds(self, moved_head_tokens: int = 0) -> float:
        """Time on a replica's slot; a head that moved here is imported first."""
        return (self.new_prompt_tokens / PREFILL_TOKENS_PER_S + self.output_tokens / DECODE_TOKENS_PER_S
                + moved_head_tokens / IMPORT_TOKENS_PER_S)
