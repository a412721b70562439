"""A deterministic request with a grammar: the same bits alone, under load, and through forced
rollbacks (an injected mismatch feeds a token the grammar refuses; the verify pass must draw
under the masks of the verified tokens, not of the refused one). Its reply follows the schema."""

from __future__ import annotations

import json

import jsonschema

from tests.determinism.helpers import DET_PROMPTS, Arrival, background_load, det_params, drive, new_engine
from tests.grammar.schemas import random_schema
from workers.checkpoint import Arch

SCHEMAS = {f"s{i}": random_schema(40 + i) for i in range(3)}


def _arrivals(temperature: float) -> list[Arrival]:
    prompts = list(DET_PROMPTS.values())
    return [Arrival(i, rid, prompts[i % len(prompts)],
                    det_params(max_tokens=400, ignore_eos=False, temperature=temperature,
                               constraint={"type": "json_schema", "schema": schema}))
            for i, (rid, schema) in enumerate(SCHEMAS.items())]


def test_constrained_deterministic_replies_are_bit_identical_alone_under_load_and_rollback(det_models):
    model = det_models[Arch.BAMBA]
    for temperature in (0.0, 0.9):
        alone = drive(new_engine(model), _arrivals(temperature))
        loaded = drive(new_engine(model), _arrivals(temperature) + background_load(seed=5))
        rolled = new_engine(model, mismatch_rate=0.3)
        rolled_back = drive(rolled, _arrivals(temperature) + background_load(seed=6))
        assert rolled.verifier.metrics.rollbacks > 0
        assert loaded.of(SCHEMAS) == alone.of(SCHEMAS)
        assert rolled_back.of(SCHEMAS) == alone.of(SCHEMAS)
        assert not loaded.unverified_streamed and not rolled_back.unverified_streamed
        for rid, schema in SCHEMAS.items():
            jsonschema.validate(json.loads(alone.text[rid]), schema)
