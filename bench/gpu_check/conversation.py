"""A conversation turn continued from the cached head == the same turn recomputed from scratch.

One engine keeps the conversation (`workers.conversation.ConversationCache`, turns committed at
once); a second, stateless engine gets the turn's whole prompt (the history the ledger holds,
rendered with the new message). Greedy, fp32 on the device: the tokens must be equal and the
sampled tokens' logprobs within 1e-4 (tests/conversation's bound).
"""

from __future__ import annotations

from pathlib import Path

import torch

from proto.contract import ConversationRef
from workers.config import CacheConfig, EngineConfig
from workers.conversation.cache import ConversationCache
from workers.engine import LLMEngine
from workers.sampling import SamplingParams

LOGPROB_TOL = 1e-4
MESSAGES = ("Explain how a hybrid model keeps its state.", "And what does the cache hold?",
            "Say it again, shorter.", "Which layers attend?")  # fmt: skip


def engine_on(model_dir: Path, device: torch.device, dtype: torch.dtype = torch.float32, **cache) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device=str(device), dtype=dtype, cache=CacheConfig(**cache)))


def drive(engine: LLMEngine) -> dict[str, dict]:
    results: dict[str, dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "logprobs": [], "cached": 0, "error": None})
            r["tokens"] += out.new_token_ids
            r["logprobs"] += [t.logprob for t in out.new_tokens]
            r["cached"] = out.num_cached_tokens
            if out.finished:
                r["error"] = out.error
    return results


def check(model_dir: Path, device: torch.device, turns: int, reply_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=reply_tokens, logprobs=0)
    cached_engine, stateless = engine_on(model_dir, device), engine_on(model_dir, device)
    cc = ConversationCache(cached_engine)
    ref = ConversationRef("gpu-check", "salt")
    for turn in range(turns):
        cc.begin_turn(ref, [{"role": "user", "content": MESSAGES[turn % len(MESSAGES)]}], params, f"turn-{turn}")
        done = drive(cached_engine)[f"turn-{turn}"]
        if done["error"]:
            raise RuntimeError(f"turn {turn}: {done['error']}")
    history = cc.describe(ref)["messages"]
    new = [{"role": "user", "content": MESSAGES[turns % len(MESSAGES)]}]
    cc.begin_turn(ref, new, params, "checked")
    cached = drive(cached_engine)["checked"]
    tok = stateless.tokenizer
    prompt = tok.encode(tok.render_chat(history + new))
    stateless.add_request("recomputed", prompt, params)
    full = drive(stateless)["recomputed"]
    diff = max((abs(a - b) for a, b in zip(cached["logprobs"], full["logprobs"])), default=0.0)
    same = cached["tokens"] == full["tokens"]
    return {
        "turns_before": turns,
        "prompt_tokens": len(prompt),
        "cached_tokens": cached["cached"],
        "reply_tokens": len(cached["tokens"]),
        "tokens_equal": same,
        "max_logprob_diff": diff,
        "logprob_bound": LOGPROB_TOL,
        "errors": [e for e in (cached["error"], full["error"]) if e],
        "passed": same and diff <= LOGPROB_TOL and cached["cached"] > 0 and not (cached["error"] or full["error"]),
    }
