"""Shared fixtures of the engine tests: tiny checkpoints, engines with integrity checks,
and the slow references (transformers' full forward, our model run chunk by chunk).

Every engine made through `new_engine` (or the fixtures built on it) is checked after
every test: free + cached + in-use == total for KV blocks and Mamba slots, and an idle
engine holds nothing.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.cache.layout import layouts_for
from workers.checkpoint import NEVER_SAMPLE_TOKEN_IDS, Arch, Preset, build_random_model, make_model, write_tokenizer
from workers.checkpoint.metadata import ServingMetadata
from workers.config import CacheConfig, EngineConfig, SchedulerConfig, WeightQuantization
from workers.engine import LLMEngine
from workers.kernels.linear_plan import LinearPlan
from workers.model.config import MambaShape
from workers.model.hybrid_lm import HybridLM
from workers.model.mamba_mixer import MambaMixer
from workers.request import Request
from workers.runner import ModelRunner
from workers.sampling import SamplingParams
from workers.scheduler import ScheduledChunk

MiB = 1 << 20
LOGIT_TOL = 1e-4  # max abs diff of logits divided by the reference's std
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

# -- engines, checked after every test -------------------------------------------------------
_ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()


def new_engine(
    model_dir: Path | str,
    *,
    block_size: int = 16,
    kv_cache_bytes: int = 4 * MiB,
    num_state_slots: int = 0,
    head_cache_bytes: int = 1 * MiB,
    prefix_cache_bytes: int = 1 * MiB,
    tool_pause_share: float = CacheConfig.tool_pause_share,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 0,
    dtype: torch.dtype = torch.float32,
    weight_quantization: WeightQuantization = WeightQuantization.NONE,
) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            weight_quantization=weight_quantization,
            max_model_len=max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_bytes=kv_cache_bytes,
                num_state_slots=num_state_slots,
                head_cache_bytes=head_cache_bytes,
                prefix_cache_bytes=prefix_cache_bytes,
                tool_pause_share=tool_pause_share,
            ),
        )
    )
    _ENGINES.add(engine)
    return engine


def kv_bytes_for_blocks(model_dir: Path | str, usable_blocks: int, block_size: int) -> int:
    """kv_cache_bytes that gives exactly `usable_blocks` blocks (plus the null block)."""
    from workers.model.loader import read_model_config

    kv, _ = layouts_for(read_model_config(Path(model_dir)), 1, block_size, 1, torch.float32)
    return usable_blocks * kv.block_bytes


def assert_all_free(engine: LLMEngine) -> None:
    kv = engine.caches.kv.usage()
    slots = engine.caches.states.usage()
    assert kv.free == kv.total and kv.in_use == 0 and kv.cached == 0, kv
    assert slots.free == slots.total and slots.in_use == 0 and slots.cached == 0, slots


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models are all per-op overhead: one thread is faster, and immune to the spin-waits
    of a second OpenMP thread on a busy machine (10-40x slower when other jobs run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_idle(engine: LLMEngine) -> None:
    """Nothing in use; what is cached belongs to prefix checkpoints (check_integrity knows them)."""
    kv = engine.caches.kv.usage()
    slots = engine.caches.states.usage()
    assert kv.in_use == 0 and slots.in_use == 0, (kv, slots)
    if not engine.caches.heads.checkpoints:
        assert_all_free(engine)


@pytest.fixture(autouse=True)
def _engine_integrity():
    yield
    for engine in list(_ENGINES):
        engine.check_integrity()
        if not engine.has_unfinished():
            assert_idle(engine)


# -- checkpoints --------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    path: Path
    with_tokenizer: bool

    @cached_property
    def hf(self):
        return AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True, dtype=torch.float32).eval()

    @cached_property
    def ours(self) -> HybridLM:
        from workers.model.loader import load_model

        return load_model(self.path)

    @property
    def banned(self) -> tuple[int, ...]:
        """The ids the engine never samples: hybridserve.json's (the trained model's BPE has its
        own), none without a tokenizer."""
        meta = ServingMetadata.read(self.path) if self.with_tokenizer else None
        return meta.never_sample_token_ids if meta else ()

    @property
    def vocab_size(self) -> int:
        return json.loads((self.path / "config.json").read_text())["vocab_size"]


def write_checkpoint(out: Path, config, seed: int = 0, with_tokenizer: bool = False) -> Checkpoint:
    """save_pretrained of a random transformers model (plus tokenizer and metadata if asked)."""
    model = build_random_model(config, seed)
    model.save_pretrained(out)
    if with_tokenizer:
        write_tokenizer(out)
        ServingMetadata((config.eos_token_id,), NEVER_SAMPLE_TOKEN_IDS, config.vocab_size).write(out)
    ckpt = Checkpoint(Path(out), with_tokenizer)
    ckpt.__dict__["hf"] = model  # the very model that was saved
    return ckpt


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[Arch, Checkpoint]:
    """The tiny preset of each family, as `make-model` writes it (tokenizer, hybridserve.json)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: Checkpoint(make_model(root / arch.value, arch, Preset.TINY, seed=0), True) for arch in Arch}


# -- references -----------------------------------------------------------------------------
@torch.no_grad()
def hf_logits(ckpt: Checkpoint, ids: list[int]) -> torch.Tensor:
    """transformers' full-sequence forward: logits [len(ids), vocab] (no cache)."""
    return ckpt.hf(torch.tensor([ids]), use_cache=False).logits[0].float()


def hf_greedy(ckpt: Checkpoint, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by repeated full forwards (argmax of the last position, banned ids masked)."""
    ids = list(prompt)
    for _ in range(n):
        last = hf_logits(ckpt, ids)[-1]
        if ckpt.banned:
            last[list(ckpt.banned)] = -torch.inf
        ids.append(int(torch.argmax(last)))
    return ids[len(prompt) :]


@torch.no_grad()
def our_logits(
    model: HybridLM,
    ids: list[int],
    chunks: list[int] | None = None,
    block_size: int = 16,
    fast_kernels: bool = True,
    linear_plan: LinearPlan | None = None,
) -> torch.Tensor:
    """Our model over `ids`, run as consecutive chunks of the given sizes through the runner
    (a chunk of 1 after the first token takes the decode path); logits of every position.

    The block table is deliberately not in order, so paging arithmetic is exercised. The model
    (often the shared session one) is left on the reference path afterwards.
    """
    chunks = chunks or [len(ids)]
    assert sum(chunks) == len(ids)
    n_blocks = -(-len(ids) // block_size)
    kv, state = layouts_for(model.config, n_blocks + 3, block_size, 3, torch.float32)
    quantization = WeightQuantization.INT8 if linear_plan is not None and linear_plan.quantized else WeightQuantization.NONE
    runner = ModelRunner(model, kv, state, "cpu", fast_kernels, linear_plan, weight_quantization=quantization)
    table = list(range(n_blocks + 2, 2, -1))  # [n+2, n+1, ..., 3]: reversed, skipping 1 and 2
    request = Request("ref", list(ids), GREEDY)
    out, start = [], 0
    try:
        for n in chunks:
            batch, _ = runner.build_batch([ScheduledChunk(request, start, n, table, state_slot=2)])
            out.append(model.compute_logits(model(batch, runner.caches)))
            start += n
    finally:
        runner.set_fast_kernels(False)
    return torch.cat(out).float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = LOGIT_TOL) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    scale = ref.std()
    diff = float(((ours - ref) / scale).abs().max())
    assert diff <= tol, f"max scaled |diff| {diff:.3g} > {tol}"


# -- running engines --------------------------------------------------------------------------
class LogitRecorder:
    """Wraps engine.runner.execute: the logits each request was sampled from, in order."""

    def __init__(self, engine: LLMEngine):
        self.rows: dict[str, list[torch.Tensor]] = {}
        inner = engine.runner.execute

        def execute(step):
            logits = inner(step)
            sampling = [c for c in step.chunks if c.samples]
            for chunk, row in zip(sampling, logits):
                self.rows.setdefault(chunk.request.request_id, []).append(row.detach().clone())
            return logits

        engine.runner.execute = execute

    def stacked(self, request_id: str) -> torch.Tensor:
        return torch.stack(self.rows[request_id])


@dataclass
class Run:
    requests: dict[str, Request]
    tokens: dict[str, list[int]]
    text: dict[str, str]
    outputs: dict[str, list]  # every RequestOutput per request
    preempted: list[str]
    steps: int


def run_engine(
    engine: LLMEngine,
    prompts: dict[str, list[int]] | list[list[int]],
    params: SamplingParams | dict[str, SamplingParams] = GREEDY,
    max_steps: int = 10_000,
) -> Run:
    """Add all prompts, step until idle (bounded: a livelocked engine fails, not hangs)."""
    if not isinstance(prompts, dict):
        prompts = {f"r{i}": p for i, p in enumerate(prompts)}
    requests = {
        rid: engine.add_request(rid, p, params[rid] if isinstance(params, dict) else params)
        for rid, p in prompts.items()
    }
    run = Run(requests, {r: [] for r in prompts}, {r: "" for r in prompts}, {r: [] for r in prompts}, [], 0)
    inner_schedule = engine.scheduler.schedule

    def schedule():
        out = inner_schedule()
        run.preempted.extend(out.preempted)
        return out

    engine.scheduler.schedule = schedule
    try:
        while engine.has_unfinished():
            run.steps += 1
            assert run.steps <= max_steps, f"engine still busy after {max_steps} steps"
            for out in engine.step():
                run.tokens[out.request_id].extend(out.new_token_ids)
                run.text[out.request_id] += out.text_delta
                run.outputs[out.request_id].append(out)
    finally:
        del engine.scheduler.schedule
    return run


def prompt_of(length: int, seed: int, vocab: int = 104, low: int = 6) -> list[int]:
    """A deterministic prompt of ordinary (never banned) token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, min(vocab, 103), (length,), generator=g).tolist()


def random_mamba_mixer(
    *, groups: int, dt_max: float, seed: int, head_dim: int = 16, conv_bias: bool = True, dt_min: float = 0.001,
    d_state: int = 24,
) -> MambaMixer:
    """A small Mamba2 mixer (8 heads, d_state 24 unless given, hidden 32) with random parameters of
    scale 0.5, for comparing a fast mixer path with its reference."""
    torch.manual_seed(seed)
    shape = MambaShape(
        n_heads=8, head_dim=head_dim, n_groups=groups, d_state=d_state, d_conv=4, chunk_size=16,
        conv_bias=conv_bias, proj_bias=False, dt_min=dt_min, dt_max=dt_max,
    )  # fmt: skip
    mixer = MambaMixer(32, shape, 1e-6)
    for p in mixer.parameters():
        p.data = torch.randn_like(p) * 0.5
    return mixer.requires_grad_(False)
