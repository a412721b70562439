"""Deterministic requests on mixture-of-experts models: the verify tiles run every expert on
every row (`tile_model.tile_moe`), so the routing of other requests cannot change a request's
bits."""

from __future__ import annotations

import pytest

from tests.determinism.helpers import DET_PROMPTS, background_load, det_arrivals, drive, new_engine
from workers.checkpoint import Arch, Preset, make_model


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("determinism-moe")
    return {arch: make_model(root / arch.value, arch, Preset.TINY, seed=1, moe=True) for arch in (Arch.GRANITEMOEHYBRID, Arch.NEMOTRON_H)}


@pytest.mark.parametrize("arch", [Arch.GRANITEMOEHYBRID, Arch.NEMOTRON_H], ids=lambda a: a.value)
def test_moe_runs_under_load_are_bit_identical(moe_models, arch):
    engine = new_engine(moe_models[arch])
    reference = drive(engine, det_arrivals())
    assert all(len(reference.tokens[r]) == 40 for r in DET_PROMPTS)
    for run in range(3):
        load = background_load(seed=100 * run + 1)
        outcome = drive(engine, det_arrivals() + load)
        assert outcome.of(DET_PROMPTS) == reference.of(DET_PROMPTS), f"run {run} with {len(load)} others"
        assert not outcome.unverified_streamed
