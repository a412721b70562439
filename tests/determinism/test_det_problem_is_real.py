"""Without the flag, batch composition changes bits on this CPU; with it, it does not."""

from __future__ import annotations

from tests.determinism.helpers import Arrival, det_params, drive, new_engine
from workers.checkpoint import Arch
from workers.sampling import SamplingParams

PROMPT = [(5 * i) % 90 + 6 for i in range(9)]
NEIGHBOURS = [[(3 * i + j) % 90 + 6 for i in range(6 + 3 * j)] for j in range(7)]


def _logits_rows(engine, arrivals, request_id):
    rows = []
    inner = engine.runner.execute

    def execute(step):
        logits = inner(step)
        for chunk, row in zip([c for c in step.chunks if c.samples], logits):
            if chunk.request.request_id == request_id:
                rows.append(row.clone())
        return logits

    engine.runner.execute = execute
    drive(engine, arrivals)
    return rows


def test_batch_composition_changes_bits_without_the_flag(det_models):
    engine = new_engine(det_models[Arch.BAMBA])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = _logits_rows(engine, [Arrival(0, "r", PROMPT, params)], "r")
    crowd = [Arrival(0, f"n{j}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for j, p in enumerate(NEIGHBOURS)]
    batched = _logits_rows(new_engine(det_models[Arch.BAMBA]), [Arrival(0, "r", PROMPT, params), *crowd], "r")
    assert len(alone) == len(batched) == 12
    differing = [i for i, (a, b) in enumerate(zip(alone, batched)) if not a.equal(b)]
    assert differing, "the same request gave the same logits bits alone and in a batch of 8"


def test_the_flag_makes_the_same_request_bit_identical(det_models):
    params = det_params(max_tokens=12)
    crowd = [Arrival(0, f"n{j}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for j, p in enumerate(NEIGHBOURS)]
    alone = drive(new_engine(det_models[Arch.BAMBA]), [Arrival(0, "r", PROMPT, params)])
    batched = drive(new_engine(det_models[Arch.BAMBA]), [Arrival(0, "r", PROMPT, params), *crowd])
    assert alone.of(["r"]) == batched.of(["r"])
    assert len(alone.tokens["r"]) == 12 and not alone.unverified_streamed and not batched.unverified_streamed
