"""bench.agent's decode-step measure (bench/agent/decode.py: step_gaps) on delta arrival times
whose step is known: it must read the step, however the stream's deltas were bunched in transit."""

from __future__ import annotations

import statistics

import pytest

from bench.agent.decode import step_gaps
from bench.agent.workload import StepRecord

STEP_S = 0.030


def record(times: list[float]) -> StepRecord:
    return StepRecord(conversation=0, turn=0, delta_at_s=times)


def bunched(first: float, tokens: int, burst: int) -> list[float]:
    """One delta per decode step of STEP_S, read `burst` at a time (each at its burst's last step)."""
    steps = [first + i * STEP_S for i in range(tokens)]
    return [steps[min(len(steps) - 1, (i // burst) * burst + burst - 1)] + 1e-4 * (i % burst) for i in range(tokens)]


@pytest.mark.parametrize("burst", [1, 2, 3])
def test_the_step_is_read_whatever_the_bursts(burst):
    recs = [record(bunched(first=0.001 * i, tokens=41, burst=burst)) for i in range(8)]
    means, whole = step_gaps(recs)
    assert whole and len(means) == 8
    # The median of single gaps reads 0 or a multiple of the step as soon as deltas come in bursts.
    assert statistics.median(means) == pytest.approx(STEP_S, rel=0.1)


def test_a_batch_that_never_streams_whole_is_measured_over_every_delta():
    early = record([i * STEP_S for i in range(10)])
    late = record([1.0 + i * STEP_S for i in range(10)])  # starts after `early` ended
    means, whole = step_gaps([early, late])
    assert not whole and means == pytest.approx([STEP_S, STEP_S])
