"""Fixtures of the deterministic-mode tests: tiny checkpoints, integrity after every test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.determinism.helpers import ENGINES
from workers.checkpoint import Arch, Preset, make_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread is fastest, and the verifier fixes its own count anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def det_models(tmp_path_factory) -> dict[Arch, Path]:
    root = tmp_path_factory.mktemp("determinism-models")
    return {arch: make_model(root / arch.value, arch, Preset.TINY, seed=1) for arch in Arch}


@pytest.fixture(autouse=True)
def _integrity():
    yield
    for engine in list(ENGINES):
        engine.check_integrity()
        if not engine.has_unfinished():
            kv, slots = engine.caches.kv.usage(), engine.caches.states.usage()  # heads may stay cached
            assert kv.in_use == 0 and slots.in_use == 0, (kv, slots)
