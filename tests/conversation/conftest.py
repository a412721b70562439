"""Fixtures of the conversation-cache tests: tiny checkpoints of the three families, shared
stateless reference engines, and the integrity checks run after every test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conversation.helpers import CACHES, ENGINES, check_cache, check_engine, new_engine
from workers.checkpoint import Arch, Preset, make_model
from workers.engine import LLMEngine

# Seeds whose tiny models end some replies with <|end_of_turn|> within a few tokens and not
# others (granite's seed 0 ends every reply at once).
SEEDS = {Arch.BAMBA: 4, Arch.GRANITEMOEHYBRID: 2, Arch.NEMOTRON_H: 0}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny models' ops take microseconds: a second thread only adds synchronisation (and
    spinning, several times slower on a busy machine). Still a fixed count; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[Arch, Path]:
    root = tmp_path_factory.mktemp("conversation-models")
    return {arch: make_model(root / arch.value, arch, Preset.TINY, seed=SEEDS[arch]) for arch in Arch}


@pytest.fixture(scope="session")
def reference_engines(models) -> dict[Arch, LLMEngine]:
    """Stateless engines (no conversation cache), shared: they are idle between tests."""
    return {arch: new_engine(path, max_num_batched_tokens=512) for arch, path in models.items()}


@pytest.fixture(autouse=True)
def _integrity(request):
    """After every test: the engines and caches it made, and the shared reference engines."""
    before = [*ENGINES, *CACHES]  # earlier tests' leftovers (a failed test may leave a mess)
    yield
    shared = request.getfixturevalue("reference_engines") if "reference_engines" in request.fixturenames else {}
    for engine in ENGINES:
        if all(engine is not x for x in before) or engine in shared.values():
            check_engine(engine)
    for cc in CACHES:
        if all(cc is not x for x in before):
            check_cache(cc)
