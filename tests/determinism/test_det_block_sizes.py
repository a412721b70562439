"""The tile grid (W) and the KV block grid are independent: an engine with any block size
starts, serves ordinary requests, and gives deterministic requests the bits an engine with
blocks that divide W gives (key blocks are cut at tile boundaries, not at pages)."""

from __future__ import annotations

import pytest

from tests.determinism.helpers import DET_PROMPTS, ENGINES, Arrival, background_load, det_arrivals, det_params, drive, new_engine
from workers.checkpoint import Arch
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.deterministic.config import DeterministicConfig
from workers.engine import LLMEngine
from workers.sampling import SamplingParams


@pytest.mark.parametrize("block", [6, 40], ids=["straddling", "several-tiles"])
def test_deterministic_bits_do_not_depend_on_the_block_size(det_models, block):
    """W = 16; pages of 6 straddle tile edges, pages of 40 hold several tiles. Under load and
    injected rollbacks, the same tokens, logprobs and text as on pages of 4."""
    model = det_models[Arch.BAMBA]
    reference = drive(new_engine(model), det_arrivals())
    engine = new_engine(model, block=block, mismatch_rate=0.2)
    load = background_load(seed=4, max_requests=10)
    outcome = drive(engine, det_arrivals() + load)
    assert outcome.of(DET_PROMPTS) == reference.of(DET_PROMPTS)
    assert not outcome.unverified_streamed
    assert engine.verifier.metrics.rollbacks > 0
    assert all(len(outcome.tokens[a.request_id]) == a.params.max_tokens for a in load)


def _engine_544(model_dir, block: int) -> LLMEngine:
    """The default deterministic config (W = 64) and vLLM-sized hybrid blocks."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            scheduler=SchedulerConfig(max_num_seqs=8),
            cache=CacheConfig(block_size=block, kv_cache_bytes=16 << 20),
            deterministic=DeterministicConfig(num_threads=1),
        )
    )
    ENGINES.add(engine)
    return engine


def test_an_engine_with_block_size_544_starts_and_serves(det_models):
    model = det_models[Arch.NEMOTRON_H]
    engine, reference = _engine_544(model, 544), _engine_544(model, 16)
    assert engine.kv_layout.block_size == 544 and engine.config.deterministic.window == 64
    prompt = [(17 * i) % 90 + 6 for i in range(150)]  # two full tiles and a part of a third
    ordinary = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    deterministic = det_params(max_tokens=90)  # the replies cross two more tile edges
    arrivals = [Arrival(0, "o", prompt, ordinary), Arrival(0, "d", prompt, deterministic)]
    served = drive(engine, arrivals + background_load(seed=9, max_requests=6))
    alone = drive(reference, arrivals)
    assert served.tokens["o"] == alone.tokens["o"] and len(served.tokens["o"]) == 12
    assert served.of(["d"]) == alone.of(["d"]) and len(served.tokens["d"]) == 90
    assert engine.verifier.metrics.windows_verified >= 4
