"""Deterministic requests with logits processors (penalties, logit_bias, min_tokens): the verifier
applies them as the fast path does, so the output is theirs, bit-identical under any load."""

from __future__ import annotations

from tests.determinism.helpers import DET_PROMPTS, background_load, det_arrivals, det_params, drive, new_engine
from workers.checkpoint import Arch


def test_processed_deterministic_requests_are_bit_identical_under_load(det_models):
    engine = new_engine(det_models[Arch.GRANITEMOEHYBRID])
    plain = drive(engine, det_arrivals())
    stop = plain.tokens["d-short"][1]
    params = det_params(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.4,
                        logit_bias={stop: 6.0, 40: -30.0}, min_tokens=12, stop_token_ids=(stop,))
    reference = drive(engine, det_arrivals(params))  # alone
    assert reference.of(DET_PROMPTS) != plain.of(DET_PROMPTS)  # the processors changed the replies
    for rid in DET_PROMPTS:
        tokens = reference.tokens[rid]
        assert len(tokens) >= 12 and stop not in tokens[:12] and 40 not in tokens, (rid, tokens)
    for seed in (2, 9):
        outcome = drive(engine, det_arrivals(params) + background_load(seed=seed))
        assert outcome.of(DET_PROMPTS) == reference.of(DET_PROMPTS), seed
        assert not outcome.unverified_streamed


def test_greedy_deterministic_requests_with_penalties_under_load(det_models):
    engine = new_engine(det_models[Arch.BAMBA])
    params = det_params(temperature=0.0, max_tokens=24, frequency_penalty=2.0, repetition_penalty=1.2)
    reference = drive(engine, det_arrivals(params))
    assert reference.of(DET_PROMPTS) != drive(engine, det_arrivals(det_params(temperature=0.0, max_tokens=24))).of(
        DET_PROMPTS)
    outcome = drive(engine, det_arrivals(params, step=3) + background_load(seed=4))
    assert outcome.of(DET_PROMPTS) == reference.of(DET_PROMPTS)
