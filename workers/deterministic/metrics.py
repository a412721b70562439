"""Counters of the deterministic path (exposed by the engine, read by the benchmark)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DeterministicMetrics:
    passes: int = 0  # verify passes run (each one G x T tile)
    windows_verified: int = 0  # request windows replayed (prefill tiles included)
    tokens_verified: int = 0  # tokens the verifier decided (accepted candidates + its own tokens)
    rollbacks: int = 0  # windows where a candidate differed from the verifier's token
    tokens_redone: int = 0  # decoded candidates thrown away by rollbacks
    injected_mismatches: int = 0
    verify_seconds: float = 0.0
    step_seconds: float = 0.0  # whole engine steps, fast path included

    @property
    def verify_time_share(self) -> float:
        return self.verify_seconds / self.step_seconds if self.step_seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "verify_time_share": self.verify_time_share}
