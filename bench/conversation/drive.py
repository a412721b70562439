"""Driving one turn on our engine and timing its first token; the transformers side."""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.conversation.plan import KERNEL_BLOCK, SALT, THREADS
from proto.contract import ConversationRef
from workers.checkpoint.tokens import NEVER_SAMPLE_TOKEN_IDS, PAD_TOKEN_ID
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.conversation.cache import ConversationCache
from workers.conversation.prompt import build_turn_prompt
from workers.engine import LLMEngine
from workers.sampling import SamplingParams


# -- block size as vLLM picks it for hybrid models ----------------------------------------------
def vllm_hybrid_block_size(engine: LLMEngine) -> dict:
    kv, st = engine.kv_layout, engine.state_layout
    itemsize = torch.empty((), dtype=kv.dtype).element_size()
    attn_bytes_per_token = 2 * kv.n_kv_heads * kv.head_dim * itemsize  # K + V, one layer
    state_bytes = st.slot_bytes // st.num_layers  # conv + ssm, one sequence, one layer
    blocks_of_16 = -(-state_bytes // (KERNEL_BLOCK * attn_bytes_per_token))
    return {
        "block_size": KERNEL_BLOCK * blocks_of_16,
        "mamba_state_bytes_per_layer": state_bytes,
        "attention_bytes_per_token_per_layer": attn_bytes_per_token,
        "rule": "smallest multiple of 16 with block_size * attention_bytes_per_token_per_layer >= "
        "mamba_state_bytes_per_layer (vLLM HybridAttentionMambaModelConfig)",
    }


# -- engines ------------------------------------------------------------------------------------
def engine_config(model_dir: Path, block_size: int) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        num_threads=THREADS,
        # A few sequences only: one conversation is in flight; keeps the Mamba slot pool small.
        scheduler=SchedulerConfig(max_num_seqs=4),
        cache=CacheConfig(block_size=block_size, kv_cache_bytes=128 << 20, mamba_align_tokens=block_size),
    )


def warm_up(engine: LLMEngine) -> None:
    rng = random.Random(1)
    ids = [rng.randrange(8, 100) for _ in range(200)]
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


@dataclass
class Timing:
    ttft_s: float
    total_s: float
    ttft_cpu_s: float
    submit_s: float  # time inside begin_turn / add_request (prompt building, validation)
    steps: int


def probe_ttft(engine: LLMEngine, request_id: str, submit) -> float:
    """One extra TTFT sample: submit, step to the first token, abort (the turn is discarded,
    the committed head is untouched)."""
    gc.collect()
    t0 = time.perf_counter()
    submit()
    while True:
        outs = engine.step()
        mine = [o for o in outs if o.request_id == request_id]
        if any(o.error for o in mine):
            raise RuntimeError(f"{request_id}: {mine[0].error}")
        if any(o.new_tokens for o in mine):
            ttft = time.perf_counter() - t0
            break
    engine.abort(request_id)
    assert not engine.has_unfinished()
    return ttft


def drive(engine: LLMEngine, request_id: str, submit) -> tuple[Timing, object]:
    """Submit, then step the engine synchronously until the request finishes."""
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    request = submit()
    t_sub = time.perf_counter()
    first = first_cpu = None
    steps = 0
    done = False
    while not done:
        outs = engine.step()
        steps += 1
        for out in outs:
            if out.request_id != request_id:
                continue
            if out.error:
                raise RuntimeError(f"{request_id}: {out.error}")
            if first is None and out.new_tokens:
                first, first_cpu = time.perf_counter(), time.process_time()
            done = done or out.finished
        if not outs and not engine.has_unfinished():
            raise RuntimeError(f"{request_id}: the engine went idle before the request finished")
    end = time.perf_counter()
    return Timing(first - t0, end - t0, first_cpu - c0, t_sub - t0, steps), request


def cut_to_aligned(cache: ConversationCache, conversation_id: str, turn: int, block: int) -> dict:
    """Make the committed head what align mode keeps: KV up to the last full block and the
    Mamba state at that block boundary."""
    committed, aligned = cache.cut_to_aligned(ConversationRef(conversation_id, SALT), turn)
    assert aligned == committed // block * block, (aligned, committed, block)
    return {"committed": committed, "aligned": aligned}


def turn_prompt(cache: ConversationCache, conversation_id: str, suffix: list[dict]) -> list[int]:
    """The full prompt ids begin_turn builds for the next turn (ledger ids + template delta)."""
    conv = cache.ledger(ConversationRef(conversation_id, SALT))
    if conv is None:
        return build_turn_prompt(cache.engine.tokenizer, [], [], suffix).token_ids
    return build_turn_prompt(cache.engine.tokenizer, conv.tokens_until(conv.turn), conv.messages, suffix).token_ids


def finish_mode(rec: dict, mode: str, timing: Timing, req, samples: list[float], prompts: dict) -> None:
    prompts[mode] = list(req.prompt_token_ids)
    rec[mode] = asdict(timing) | {
        "ttft_first_run_s": timing.ttft_s,
        "ttft_s": min(samples),  # min of the probes and the real turn (noise only adds time)
        "ttft_median_s": statistics.median(samples),
        "ttft_samples_s": list(samples),
        "prompt_tokens": req.num_prompt_tokens,
        "reused_tokens": req.num_cached_tokens,
        "computed_prompt_tokens": req.num_prompt_tokens - req.num_cached_tokens,
        "output_token_ids": req.output_token_ids,
    }


# -- transformers ---------------------------------------------------------------------------------
class HFRunner:
    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.GenerationConfig = GenerationConfig

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[float, list[int]]:
        config = self.GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,  # ignore_eos, like the engine runs
            pad_token_id=PAD_TOKEN_ID,
            suppress_tokens=list(NEVER_SAMPLE_TOKEN_IDS),  # the engine never samples these either
        )
        ids = torch.tensor([prompt])
        gc.collect()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return time.perf_counter() - t0, out[0, len(prompt) :].tolist()
