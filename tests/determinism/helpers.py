"""Engines, loads and state captures shared by the deterministic-mode tests."""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.deterministic.config import DeterministicConfig
from workers.engine import LLMEngine
from workers.request import KeepState, Request
from workers.sampling import SamplingParams

ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()
WINDOW = 16  # tile length of the tests: prompts and replies span several tiles
BLOCK = 4


def new_engine(
    model_dir: Path | str, *, mismatch_rate: float = 0.0, rows: int = 4, kv_bytes: int = 4 << 20, block: int = BLOCK, **det
) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
            cache=CacheConfig(block_size=block, kv_cache_bytes=kv_bytes),
            deterministic=DeterministicConfig(
                window=det.pop("window", WINDOW), rows=rows, ssd_chunk=8, num_threads=1, mismatch_rate=mismatch_rate, **det
            ),
        )
    )
    ENGINES.add(engine)
    return engine


def det_params(**kw) -> SamplingParams:
    base = dict(max_tokens=40, temperature=0.8, top_p=0.95, logprobs=2, ignore_eos=True, deterministic=True)
    return SamplingParams(**{**base, **kw})


# Deterministic requests of the tests: prompts shorter than a tile, spanning tiles, and
# ending exactly on a tile boundary (32 = 2T).
DET_PROMPTS = {
    "d-short": [(7 * i) % 90 + 6 for i in range(5)],
    "d-long": [(11 * i) % 90 + 6 for i in range(37)],
    "d-aligned": [(13 * i) % 90 + 6 for i in range(32)],
}


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    retain: bool = False  # keep the state after finishing (a capture_states engine reads and frees it)


def background_load(seed: int, max_requests: int = 31) -> list[Arrival]:
    """0..max_requests ordinary requests of varied lengths, arriving at different steps."""
    rng = random.Random(seed)
    load = []
    for i in range(rng.randint(0, max_requests)):
        prompt = [rng.randrange(6, 100) for _ in range(rng.randint(1, 48))]
        params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True)
        load.append(Arrival(rng.randint(0, 12), f"bg{i}", prompt, params))
    return load


@dataclass
class Outcome:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[str]] = field(default_factory=dict)  # float.hex: bits, not values
    top: dict[str, list[tuple]] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)
    unverified_streamed: list[str] = field(default_factory=list)

    def of(self, ids) -> tuple:
        return tuple((self.tokens[r], self.logprobs[r], self.top[r], self.text[r]) for r in ids)


def drive(engine: LLMEngine, arrivals: list[Arrival], max_steps: int = 5000) -> Outcome:
    """Add each request at its step, step until idle; record what was streamed."""
    out = Outcome()
    pending = sorted(arrivals, key=lambda a: a.step)
    step = 0
    requests: dict[str, Request] = {}
    while pending or engine.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            keep = KeepState.PREPARE if a.retain else KeepState.FREE
            on_finished = getattr(engine, "capture_listener", None) if a.retain else None
            requests[a.request_id] = engine.add_request(
                a.request_id, a.prompt, a.params, keep=keep, on_finished=on_finished
            )
            for d in (out.tokens, out.logprobs, out.top):
                d[a.request_id] = []
            out.text[a.request_id] = ""
        for o in engine.step():
            assert o.error is None, o.error
            r = requests[o.request_id]
            streamed = out.tokens[o.request_id] + [t.token_id for t in o.new_tokens]
            verified = r.token_ids[r.num_prompt_tokens : r.num_verified]
            if r.deterministic and streamed != verified[: len(streamed)]:
                out.unverified_streamed.append(o.request_id)
            out.tokens[o.request_id] += [t.token_id for t in o.new_tokens]
            out.logprobs[o.request_id] += [t.logprob.hex() if t.logprob is not None else None for t in o.new_tokens]
            out.top[o.request_id] += [tuple((i, v.hex()) for i, v in t.top_logprobs or ()) for t in o.new_tokens]
            out.text[o.request_id] += o.text_delta
        step += 1
        assert step <= max_steps, "engine still busy"
    return out


def det_arrivals(params: SamplingParams | None = None, step: int = 0, retain: bool = False) -> list[Arrival]:
    return [Arrival(step, rid, p, params or det_params(), retain) for rid, p in DET_PROMPTS.items()]


@dataclass
class StateCapture:
    """Bytes of a finished request's committed state: KV of its computed positions, both Mamba slots."""

    kv: dict[str, bytes] = field(default_factory=dict)
    slots: dict[str, bytes] = field(default_factory=dict)
    lengths: dict[str, tuple[int, int]] = field(default_factory=dict)


def capture_states(engine: LLMEngine) -> StateCapture:
    """Requests kept as prepared states (Arrival.retain): on finish, read the prepared
    state's bytes, then abandon it."""
    capture = StateCapture()
    caches, bs = engine.runner.caches, engine.kv_layout.block_size

    def listener(request: Request) -> None:
        prepared = request.prepared
        if prepared is None:
            return
        table = engine.caches.kv.table(prepared.holder)
        pos = torch.arange(prepared.state_len)
        flat = torch.tensor(table)[pos // bs] * bs + pos % bs
        capture.kv[request.request_id] = b"".join(c.flatten(1, 2)[:, flat].contiguous().numpy().tobytes() for c in caches.kv)
        slots = engine.caches.states.slots[prepared.holder]
        capture.slots[request.request_id] = b"".join(
            t[s].contiguous().numpy().tobytes() for s in slots for t in caches.conv + caches.ssm
        )
        capture.lengths[request.request_id] = (prepared.state_len, prepared.aligned_len)
        engine.caches.heads.release(prepared)

    engine.capture_listener = listener
    return capture
