"""The engine loop: admit requests, schedule a step, run it, sample, report outputs.

Synchronous and single-threaded by design; `workers.async_engine` runs it on a thread and
gives asyncio callers streams of outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.cache.coordinator import CacheCoordinator
from workers.cache.heads import HeadManager
from workers.cache.kv_blocks import KVCacheManager
from workers.cache.layout import layouts_for
from workers.cache.mamba_slots import MambaStateManager
from workers.config import EngineConfig
from workers.deterministic.seed import derived_seed
from workers.deterministic.verifier import Verifier
from workers.detokenizer import Detokenizer
from workers.grammar.compiler import GrammarCompiler
from workers.grammar.guide import GrammarError, TokenGuide
from workers.tools.formats import tool_format_for
from proto.contract import ModelIdentity
from workers.errors import InvalidRequestError, PromptTooLongError, RequestIdInUseError
from workers.identity import model_identity
from workers.model.loader import load_model
from workers.cache.prefix_index import prefix_keys
from workers.request import CheckpointMark, FinishReason, HeadAttachment, KeepState, Request, RequestStatus, ReuseSource
from workers.runner import ModelRunner
from workers.sampling import SampledToken, SamplingParams, sample
from workers.scheduler import Scheduler
from workers.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (a delta, not the whole text)."""

    request_id: str
    new_tokens: tuple[SampledToken, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    seed: int = 0  # the sampling seed used (drawn from the OS for unseeded requests)
    # What the request's on_finished returned, on its final output: a conversation turn's
    # `TurnCommit` (see workers/conversation/API.md).
    turn_commit: Any = None
    # Prefix reuse, on the final output: the prefix checkpoints the request made, as (the mark's
    # label, tokens) — the worker labels a mark by the messages it covers, k for messages[:k]
    # (len(messages) + 1: the messages and the reply), and announces them to the prefix index
    # (deployments/routing/prefix_hints.py) — and where its reused state came from.
    checkpoints: tuple[tuple[int, int], ...] = ()
    reused_from: ReuseSource = ReuseSource.NONE

    @property
    def new_token_ids(self) -> list[int]:
        return [t.token_id for t in self.new_tokens]


def _keyed_marks(scope: str, prompt: list[int], marks: tuple[CheckpointMark, ...]) -> tuple[CheckpointMark, ...]:
    """The marks inside the prompt, by position, each with the name of the prefix it ends."""
    positions = sorted({m.position for m in marks if 0 < m.position < len(prompt)})
    keys = {k.length: k for k in prefix_keys(scope, list(prompt), positions)}
    return tuple(dataclasses.replace(m, key=keys[m.position]) for m in sorted(marks, key=lambda m: m.position)
                 if m.position in keys)


def _grammar_masks(requests: list[Request], banned: torch.Tensor) -> tuple[list[torch.Tensor | None] | None, dict]:
    """Per row, the tokens its grammar allows next (None: the batch has no constrained request),
    and the requests whose grammar failed or allows nothing that may be sampled (request id ->
    why): they fail alone, whatever their rows draw."""
    if all(r.guide is None for r in requests):
        return None, {}
    masks, failed = [], {}
    for request in requests:
        mask = None
        if request.guide is not None:
            try:
                mask = request.guide.allowed(request.reply_ids)
            except GrammarError as e:
                failed[request.request_id] = str(e)
            if mask is not None and not mask.index_fill(0, banned, False).any():
                failed[request.request_id] = "the grammar allows no token the model may sample"
                mask = None
        masks.append(mask)
    return masks, failed


def _prefetch_mask(request: Request) -> None:
    if request.guide is not None:
        request.guide.prefetch(request.reply_ids)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_dir = Path(config.model)
        self.model = load_model(model_dir, config.dtype, config.device)
        self.model_config = self.model.config
        self.tokenizer = ChatTokenizer(model_dir)
        model_limit = config.max_model_len or self.model_config.max_position_embeddings
        eos = set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids())
        self.eos_token_ids = frozenset(eos)
        self.banned_token_ids = torch.tensor(sorted(self.tokenizer.never_sample_ids), dtype=torch.long)
        self.tool_format = tool_format_for(self.tokenizer.chat_template)
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.model_config.vocab_size, eos, self.tool_format)
        # Masks of constrained requests are computed here while the model runs (guide.py).
        self._mask_threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-mask")

        cache = config.cache
        probe_kv, probe_state = layouts_for(self.model_config, 1, cache.block_size, 1, config.dtype)
        num_blocks = max(2, cache.kv_cache_bytes // max(1, probe_kv.block_bytes) + 1)
        max_seqs = config.scheduler.max_num_seqs
        head_slots = min(4 * max_seqs, max(8, cache.head_cache_bytes // probe_state.slot_bytes))
        checkpoint_slots = min(4 * max_seqs, cache.prefix_cache_bytes // probe_state.slot_bytes)
        # A turn that will publish holds two slots (running state + aligned snapshot).
        num_slots = cache.num_state_slots or 2 * max_seqs + head_slots + checkpoint_slots
        self.kv_layout, self.state_layout = layouts_for(
            self.model_config, num_blocks, cache.block_size, num_slots, config.dtype
        )
        # A request longer than the whole pool could never run: cap the length limit there.
        self.max_model_len = min(model_limit, self.kv_layout.usable_blocks * cache.block_size)
        self.runner = ModelRunner(
            self.model, self.kv_layout, self.state_layout, config.device, weight_quantization=config.weight_quantization
        )
        kv, states = KVCacheManager(self.kv_layout), MambaStateManager(self.state_layout)
        if cache.prefix_cache_bytes and not checkpoint_slots:
            log.warning("prefix_cache_bytes %d is less than one Mamba state (%d bytes): no prefix checkpoints",
                        cache.prefix_cache_bytes, probe_state.slot_bytes)
        heads = HeadManager(
            kv, states, cache.head_cache_bytes, cache.prepared_turn_timeout_s, cache.prefix_cache_bytes,
            checkpoint_slots, cache.tool_pause_s,
        )
        self.caches = CacheCoordinator(kv, states, heads, self.runner.copy_slots)
        self.scheduler = Scheduler(config.scheduler, self.caches, cache.align_tokens)
        self.verifier = Verifier(
            config.deterministic, self.model, self.runner.caches, self.caches, self.banned_token_ids
        )
        self._detok: dict[str, Detokenizer] = {}

    # -- admission ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        head: HeadAttachment | None = None,
        keep: KeepState = KeepState.FREE,
        on_finished: Callable[[Request], Any] | None = None,
        prefill_only: bool = False,
        prefix_scope: str | None = None,
        marks: tuple[CheckpointMark, ...] = (),
        final_label: int = 0,
    ) -> Request:
        """Queue a request. `keep` says what happens to its state when it completes;
        `on_finished` runs on this thread when it ends, however it ends (see Request).

        With a `prefix_scope` (the cache salt) its states are named by their token prefixes in
        that scope: without a `head`, it attaches the longest prefix of its prompt held when it
        is admitted (a burst sharing a system prompt: the first one's mark serves the rest); it
        checkpoints its state at `marks`; a kept state (prepared turn, keep=CHECKPOINT, labelled
        `final_label`) is named too. Deterministic requests neither look up nor mark: no
        checkpoint is canonical (they recompute in tiles, as on a miss)."""
        self._validate(request_id, prompt_token_ids, params)
        guide = None
        if params.constraint is not None:  # a bad schema is refused here, before anything runs
            guide = TokenGuide(self.grammars.matcher(params.constraint), self.model_config.vocab_size,
                               self._mask_threads)
        if params.deterministic and head is not None and head.canonical_window != self.config.deterministic.window:
            head = None  # the fast path made that state: recompute the whole prompt in tiles (a miss)
        reuse = prefix_scope is not None and not params.deterministic and self.caches.heads.checkpoint_budget_bytes > 0
        if keep is KeepState.CHECKPOINT and not reuse:
            keep = KeepState.FREE
        if params.seed is None and params.deterministic:
            params = dataclasses.replace(params, seed=derived_seed(prompt_token_ids))  # same on every replica
        elif params.seed is None:
            params = dataclasses.replace(params)  # a fresh random seed per request, not per params object
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            head=head,
            keep=keep,
            on_finished=on_finished,
            prefill_only=prefill_only,
            # a prepared turn's head is named (found by requests that do reuse) even with reuse off
            prefix_scope=prefix_scope if reuse or keep is KeepState.PREPARE else None,
            prefix_lookup=reuse,
            marks=_keyed_marks(prefix_scope, prompt_token_ids, marks) if reuse else (),
            final_label=final_label,
        )
        if guide is not None:
            request.guide = guide
            guide.prefetch(())  # the first mask, while the prompt runs
        self._detok[request_id] = Detokenizer(self.tokenizer, params.stop)
        self.scheduler.add(request)
        return request

    def _validate(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if request_id in self.scheduler.requests:
            raise RequestIdInUseError(f"request id {request_id!r} is already running")
        if self.caches.heads.prepared_of(request_id) is not None:  # its id names it until resolved
            raise RequestIdInUseError(f"request id {request_id!r} names a prepared turn awaiting commit or abandon")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
            raise InvalidRequestError("token ids must be integers")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; this model's limit is {self.max_model_len} (prompt + output)"
            )
        blocks = -(-(len(ids) + 1) // self.kv_layout.block_size)
        if blocks > self.kv_layout.usable_blocks:
            raise PromptTooLongError(f"prompt of {len(ids)} tokens cannot fit the KV cache ({blocks} blocks)")

    def abort(self, request_id: str) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self._finish(request, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        self.expire_prepared()
        outputs = self._fast_step()
        outputs += self._verify_step()
        self.verifier.metrics.step_seconds += time.perf_counter() - started
        return outputs

    @torch.inference_mode()  # the step's logits are masked in place before sampling
    def _fast_step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        outputs = [self._fail(r, "the request does not fit in the KV cache") for r in step.unfittable]
        if not step.chunks:
            # Admitted deterministic prefills run no chunk, but their slots must be zeroed
            # (or copied from a head) before their first verify pass reads them.
            self.runner.apply_copies(step.copies)
            return outputs
        ending = [c for c in step.chunks if c.samples]
        rows = [i for i, c in enumerate(ending) if not c.request.prefill_only]
        sampling = [ending[i] for i in rows]
        masks, grammar_failed = _grammar_masks([c.request for c in sampling], self.banned_token_ids)
        try:
            logits = self.runner.execute(step)
            sampled = sample(
                logits[rows] if len(rows) != len(ending) else logits,
                [c.request.params for c in sampling],
                [c.request.num_tokens for c in sampling],
                self.banned_token_ids,
                overwrite=True,  # the step's own logits: mask the never-sampled ids in place
                allowed=masks,
            )
        except Exception as e:  # a failing step fails its requests; the engine keeps serving
            log.exception("model step failed")
            return outputs + [self._fail(c.request, f"model step failed: {e}") for c in step.chunks]
        self.scheduler.advance(step)
        for chunk, token in zip(sampling, sampled):
            if chunk.request.request_id in grammar_failed:
                outputs.append(self._fail(chunk.request, grammar_failed[chunk.request.request_id]))
            elif chunk.request.deterministic:  # a candidate: nothing reaches the client unverified
                self.verifier.on_candidate(chunk.request, token, self._ends)
                _prefetch_mask(chunk.request)
            else:
                outputs.append(self._on_token(chunk.request, token))
        for chunk in ending:
            if chunk.request.prefill_only:  # its state now covers the whole prompt: done
                self._finish(chunk.request, FinishReason.STOP)
                outputs.append(self._output(chunk.request, (), ""))
        return outputs

    def _verify_step(self) -> list[RequestOutput]:
        """Verify passes (G requests each) for every deterministic request waiting for one;
        only what they accept goes through the stop checks to the detokenizer and the stream."""
        due = [r for r in self.scheduler.running if r.verify_due]
        outputs: list[RequestOutput] = []
        for i in range(0, len(due), self.config.deterministic.rows):
            group = due[i : i + self.config.deterministic.rows]
            try:
                verdicts = self.verifier.verify(group)
            except Exception as e:  # as a failing model step: its requests fail, the engine goes on
                log.exception("verify pass failed")
                outputs += [self._fail(r, f"verify pass failed: {e}") for r in group]
                continue
            applied = []
            for verdict in verdicts:
                request = verdict.request
                if request.prefill_only:  # takes no token: done once its last prompt tile ran
                    ran_all = verdict.end == request.num_tokens
                    applied.append((request, [], "", FinishReason.STOP if ran_all else None))
                    continue
                del request.token_ids[verdict.first :]  # candidates out; verified tokens back in
                taken, delta, reason = [], "", None
                for token in verdict.tokens:
                    request.append(token)
                    taken.append(token)
                    text, reason = self._text_and_reason(request, token)
                    delta += text
                    if reason is not None:
                        break
                applied.append((request, taken, delta, reason))
            self.verifier.commit(verdicts, [len(taken) for _, taken, _, _ in applied])
            for request, taken, delta, reason in applied:
                if reason is not None:
                    delta += self._detok[request.request_id].flush()
                    self._finish(request, reason)
                if taken or request.is_finished:
                    outputs.append(self._output(request, taken, delta))
        return outputs

    def expire_prepared(self) -> int:
        """Abandon prepared states past their deadline (their owners never resolved them)."""
        return len(self.caches.heads.expire(time.monotonic()))

    def seconds_to_next_deadline(self) -> float | None:
        """How long an idle loop may sleep before `expire_prepared` has work (None: forever)."""
        deadline = self.caches.heads.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _on_token(self, request: Request, token: SampledToken) -> RequestOutput:
        request.append(token)
        delta, reason = self._text_and_reason(request, token)
        if reason is not None:
            delta += self._detok[request.request_id].flush()
            self._finish(request, reason)
        else:
            _prefetch_mask(request)
        return self._output(request, (token,), delta)

    def _text_and_reason(self, request: Request, token: SampledToken) -> tuple[str, FinishReason | None]:
        """The text the new last token adds, and why the request ends there (if it does)."""
        delta, stopped = self._detok[request.request_id].update(token.token_id)
        if stopped:
            return delta, FinishReason.STOP
        return delta, self._finish_reason(request, token.token_id)

    def _finish_reason(self, request: Request, token_id: int) -> FinishReason | None:
        """For the last token of request.token_ids (verified or a candidate)."""
        params = request.params
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
            return FinishReason.STOP
        if request.guide is not None and request.guide.ended_after(request.reply_ids):
            return FinishReason.STOP  # the grammar is complete: nothing may follow
        if request.num_tokens - request.num_prompt_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _ends(self, request: Request, token_id: int) -> bool:
        return self._finish_reason(request, token_id) is not None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """End a request; a failure while keeping its state or in its on_finished fails this
        request alone and frees its state (never the batch, never a leak)."""
        self._detok.pop(request.request_id, None)
        if request.guide is not None:
            request.guide.close()
            request.guide = None
        request.awaiting_tool = reason is FinishReason.STOP and self._ends_in_tool_call(request)
        try:
            self.scheduler.finish(request, reason)
        except Exception as e:
            self._failed_finish(request, e)  # on_finished still runs: it sees no prepared state
        if request.on_finished is None:
            return
        try:
            request.finish_record = request.on_finished(request)
        except Exception as e:
            self._failed_finish(request, e)

    def _ends_in_tool_call(self, request: Request) -> bool:
        """Whether the reply's text ends with the end of a tool call (only its end is decoded)."""
        end_tag = self.tool_format.end_tag
        tail = request.reply_ids[-(len(end_tag) + 4):]
        if not tail or not self.tokenizer.available:
            return False
        text = self.tokenizer.decode(tail)
        return text.rstrip().endswith(end_tag)

    def _failed_finish(self, request: Request, error: Exception) -> None:
        log.exception("request %s: finishing failed", request.request_id)
        prepared = request.prepared
        if prepared is not None and prepared.holder in self.caches.heads.prepared:
            self.caches.heads.release(prepared)
        request.prepared = None
        self.caches.discard(request)  # whatever the request still holds
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ERROR
        request.finish_error = f"finishing the request failed: {error}"

    def _fail(self, request: Request, message: str) -> RequestOutput:
        self._finish(request, FinishReason.ERROR)
        return self._output(request, (), "", error=message)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every unfinished request with an error (the loop itself failed)."""
        return [self._fail(r, message) for r in list(self.scheduler.requests.values())]

    def _output(self, request: Request, tokens, delta: str, error: str | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_tokens=tuple(tokens),
            text_delta=delta,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            error=error or request.finish_error,
            seed=request.params.resolved_seed,
            turn_commit=request.finish_record if request.is_finished else None,
            checkpoints=tuple(request.checkpoints_made) if request.is_finished else (),
            reused_from=request.reused_from,
        )

    # -- conveniences -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[SampledToken]]:
        """Run prompts to completion (tests, CLI, benchmarks); outputs in prompt order."""
        ids = [f"gen-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params)
        results: dict[str, list[SampledToken]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.error:
                    raise RuntimeError(out.error)
                results[out.request_id].extend(out.new_tokens)
        return [results[rid] for rid in ids]

    @functools.cached_property
    def identity(self) -> ModelIdentity:
        """What a foreign head's state must match (hashes the weights once)."""
        config = self.config
        return model_identity(config.model, config.dtype, config.device, config.weight_quantization)

    def load(self) -> tuple[int, int]:
        """(requests in the engine, free KV blocks), for routing stats and heartbeats."""
        return len(self.scheduler.requests), self.caches.kv.num_free

    def check_integrity(self) -> None:
        self.caches.check_integrity()
