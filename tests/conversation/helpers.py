"""Helpers of the conversation-cache tests: engines that are checked after every test,
driving turns to completion, the stateless reference, and snapshots of a head's state.

The reference for a turn is always an ordinary stateless request carrying the whole
history, rendered from the ledger's messages (`describe(...)["messages"]`) plus the turn's
new messages: the cached turn must produce the same greedy tokens and, within LOGPROB_TOL,
the same logprobs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.state_names import Holder, HolderKind
from workers.checkpoint import EOS_TOKEN_ID
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.conversation.cache import ConversationCache
from proto.contract import ConversationRef
from workers.cache.heads import CommittedHead
from workers.engine import LLMEngine
from workers.request import FinishReason, KeepState, Request
from workers.sampling import SamplingParams

MiB = 1 << 20
BLOCK = 8  # KV block size of every engine here (and the Mamba alignment)
LOGPROB_TOL = 1e-4
STATE_ATOL = 1e-4  # Mamba state / KV of a chunked vs one-shot computation

ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()
CACHES: weakref.WeakSet[ConversationCache] = weakref.WeakSet()


def greedy(max_tokens: int = 13, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, **kw)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# -- engines --------------------------------------------------------------------------------
def new_engine(
    model_dir: Path | str,
    *,
    kv_cache_bytes: int = 2 * MiB,
    head_cache_bytes: int = 64 * MiB,
    num_state_slots: int = 0,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    mamba_align_tokens: int = 0,
    prepared_turn_timeout_s: float = 60.0,
    prefix_cache_bytes: int = 0,  # off: these tests count heads, hits and misses; test_conv_prefix turns it on
) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(
                block_size=BLOCK,
                kv_cache_bytes=kv_cache_bytes,
                head_cache_bytes=head_cache_bytes,
                num_state_slots=num_state_slots,
                mamba_align_tokens=mamba_align_tokens,
                prepared_turn_timeout_s=prepared_turn_timeout_s,
                prefix_cache_bytes=prefix_cache_bytes,
            ),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        )
    )
    ENGINES.add(engine)
    return engine


def new_cache(engine: LLMEngine, retain_turns: int = 1) -> ConversationCache:
    cc = ConversationCache(engine, retain_turns=retain_turns)
    CACHES.add(cc)
    return cc


def check_engine(engine: LLMEngine) -> None:
    """check_integrity, plus: every block's reference count is the number of tables listing it."""
    engine.check_integrity()
    kv = engine.caches.kv
    listed = [0] * kv.pool.num_blocks
    for table in kv.tables.values():
        assert len(set(table)) == len(table), "a table lists a block twice"
        for b in table:
            listed[b] += 1
    listed[0] += 1  # the null block
    assert listed == kv.pool.ref_counts, "per-block reference counts disagree with the tables"
    if not engine.has_unfinished():
        requests = [h for h in [*kv.tables, *engine.caches.states.slots] if h.kind is HolderKind.REQUEST]
        assert not requests, f"an idle engine still holds request state: {requests}"


def check_cache(cc: ConversationCache) -> None:
    """Heads own exactly what the managers say heads hold; nothing pinned, pending or prepared
    when idle (a test must resolve the turns it prepared)."""
    cc.check_integrity()
    if not cc.engine.has_unfinished():
        cc.check_settled()


# -- running --------------------------------------------------------------------------------
@dataclass
class Result:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    request: Request | None = None

    @property
    def ended_by_eos(self) -> bool:
        return self.finish_reason is FinishReason.STOP and self.tokens[-1:] == [EOS_TOKEN_ID]


def drive(engine: LLMEngine, results: dict[str, Result] | None = None, max_steps: int = 2000) -> dict[str, Result]:
    """Step until idle; collects every request's tokens (bounded: a livelock fails, not hangs)."""
    results = {} if results is None else results
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return results
        for out in engine.step():
            r = results.setdefault(out.request_id, Result(out.request_id))
            r.tokens += out.new_token_ids
            r.logprobs += [t.logprob for t in out.new_tokens]
            r.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                r.finish_reason, r.error = out.finish_reason, out.error
    raise AssertionError(f"engine still busy after {max_steps} steps")


def run_turn(
    cc: ConversationCache,
    conversation_id: str,
    salt: str,
    messages: list[dict[str, Any]],
    params: SamplingParams,
    request_id: str,
) -> Result:
    request = cc.begin_turn(ConversationRef(conversation_id, salt), messages, params, request_id)
    result = drive(cc.engine)[request_id]
    result.request = request
    return result


def reference_prompt(engine: LLMEngine, history: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(history + new))


def run_stateless(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams | dict[str, SamplingParams]
) -> dict[str, Result]:
    """Ordinary requests (no conversation), all in one batch."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params[rid] if isinstance(params, dict) else params)
    results = drive(engine)
    return {rid: results[rid] for rid in prompts}


def assert_same_output(cached: Result, ref: Result, what: str = "") -> None:
    assert cached.error is None and ref.error is None, (cached.error, ref.error)
    assert cached.tokens == ref.tokens, f"{what}: cached turn {cached.tokens} != stateless {ref.tokens}"
    assert cached.finish_reason == ref.finish_reason, what
    if cached.logprobs and cached.logprobs[0] is not None:
        diff = max(abs(a - b) for a, b in zip(cached.logprobs, ref.logprobs))
        assert diff <= LOGPROB_TOL, f"{what}: logprobs differ by {diff:.3g}"


def check_turn_against_reference(
    cc: ConversationCache,
    ref: LLMEngine,
    conversation_id: str,
    salt: str,
    messages: list[dict[str, Any]],
    params: SamplingParams,
    request_id: str,
) -> Result:
    """One turn through the cache, and the same turn sent stateless with the ledger's history."""
    known = conversation(cc, conversation_id, salt)
    history = cc.describe(ConversationRef(conversation_id, salt))["messages"] if known else []
    cached = run_turn(cc, conversation_id, salt, messages, params, request_id)
    expected = run_stateless(ref, {f"ref-{request_id}": reference_prompt(ref, history, messages)}, params)
    assert_same_output(cached, expected[f"ref-{request_id}"], request_id)
    return cached


# -- heads and their state ------------------------------------------------------------------------
def conversation(cc: ConversationCache, conversation_id: str, salt: str):
    return cc.ledger(ConversationRef(conversation_id, salt))


def head_of(cc: ConversationCache, conversation_id: str, salt: str, turn: int | None = None) -> CommittedHead | None:
    """The retained head of `turn` (default: the latest), without touching the LRU order."""
    return cc.head_of(ConversationRef(conversation_id, salt), turn)


@dataclass
class StateSnapshot:
    blocks: list[int]
    slots: list[int]
    kv: list[torch.Tensor]
    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]

    def assert_equal(self, other: StateSnapshot) -> None:
        assert self.blocks == other.blocks and self.slots == other.slots
        for name in ("kv", "conv", "ssm"):
            for i, (a, b) in enumerate(zip(getattr(self, name), getattr(other, name))):
                assert torch.equal(a, b), f"{name}[{i}] of the head changed"


def snapshot(engine: LLMEngine, holder: Holder) -> StateSnapshot:
    """Copies of the holder's KV blocks (all attention layers) and Mamba slots (all layers)."""
    blocks = list(engine.caches.kv.table(holder))
    slots = list(engine.caches.states.slots[holder])
    caches = engine.runner.caches
    return StateSnapshot(
        blocks,
        slots,
        [kv[:, blocks].clone() for kv in caches.kv],
        [c[slots].clone() for c in caches.conv],
        [s[slots].clone() for s in caches.ssm],
    )


def prefill_state(engine: LLMEngine, token_ids: list[int], request_id: str = "prefill") -> StateSnapshot:
    """Terminal state (KV of every position, Mamba state in slot 0) of a stateless prefill of
    exactly `token_ids` (max_tokens=1: the sampled token is never fed). The request keeps its
    state (prepared) until it is read, then it is released."""
    request = engine.add_request(
        request_id, token_ids, SamplingParams(max_tokens=1, temperature=0.0), keep=KeepState.PREPARE
    )
    drive(engine)
    assert request.num_computed_tokens == len(token_ids)
    state = snapshot(engine, request.prepared.holder)
    engine.caches.heads.release(request.prepared)
    return state


def assert_state_close(ours: StateSnapshot, ref: StateSnapshot, *, num_tokens: int, slot: int) -> None:
    """KV of positions [0, num_tokens) and the Mamba state in `slot` (index into .slots) agree."""
    for a, b in zip(ours.conv + ours.ssm, ref.conv + ref.ssm):
        assert torch.allclose(a[slot], b[0], atol=STATE_ATOL, rtol=1e-3), float((a[slot] - b[0]).abs().max())
    for a, b in zip(ours.kv, ref.kv):
        a = a.flatten(1, 2)[:, :num_tokens]  # [2, blocks*block_size, heads, dim] -> positions
        b = b.flatten(1, 2)[:, :num_tokens]
        assert torch.allclose(a, b, atol=STATE_ATOL, rtol=1e-3), float((a - b).abs().max())
