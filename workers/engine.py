"""The engine: admit requests, schedule a step, run it, sample, report outputs.

Synchronous and single-threaded by design; `workers.async_engine` runs it on a thread and
gives asyncio callers streams of outputs. The step's parts live in workers/loop/, one job each:

    admission.py      checks a request must pass, its seed and its keyed checkpoint marks
    fast_step.py      one batch through the model, sampled (grammar_masks.py: constrained rows)
    verify_step.py    deterministic mode's verify passes
    finishing.py      detokenizer and stop checks, the tool-call pause, ending without a leak
    outputs.py        RequestOutput
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from proto.contract import ModelIdentity
from workers.cache.coordinator import CacheCoordinator
from workers.cache.heads import HeadManager
from workers.cache.kv_blocks import KVCacheManager
from workers.cache.layout import layouts_for
from workers.cache.mamba_slots import MambaStateManager
from workers.config import EngineConfig
from workers.deterministic.verifier import Verifier
from workers.grammar.compiler import GrammarCompiler
from workers.grammar.guide import TokenGuide
from workers.identity import model_identity
from workers.loop.admission import (
    check_constraint_starts, check_prompt, check_prompt_logprobs, check_request_id, keyed_marks, seeded,
)
from workers.loop.fast_step import FastStep
from workers.load import EngineLoad
from workers.loop.finishing import Finisher
from workers.loop.forks import choice_id, choice_params
from workers.loop.outputs import RequestOutput
from workers.loop.verify_step import VerifyStep
from workers.model.loader import load_model
from workers.prompt_logprobs import PromptLogprobs
from workers.request import CheckpointMark, FinishReason, HeadAttachment, KeepState, Request
from workers.runner import ModelRunner
from workers.sampling import SampledToken, SamplingParams, check_logit_bias
from workers.scheduler import Scheduler
from workers.state_names import PrefixKey
from workers.tokenizer import ChatTokenizer
from workers.tools.formats import tool_format_for

log = logging.getLogger(__name__)


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
            checkpoint_slots, cache.tool_pause_s, cache.tool_pause_share,
        )
        self.caches = CacheCoordinator(kv, states, heads, self.runner.copy_slots)
        self.scheduler = Scheduler(config.scheduler, self.caches, cache.align_tokens)
        self.verifier = Verifier(
            config.deterministic, self.model, self.runner.caches, self.caches, self.banned_token_ids,
            self.eos_token_ids,
        )
        # The step's parts (workers/loop): calls go engine -> steps -> finisher -> scheduler.
        self._finisher = Finisher(
            self.tokenizer, self.tool_format, self.eos_token_ids, self.max_model_len, self.scheduler, self.caches
        )
        self._fast_step = FastStep(self.scheduler, self.runner, self.verifier, self._finisher, self.banned_token_ids)
        self._verify_step = VerifyStep(self.scheduler, self.verifier, self._finisher, config.deterministic.rows)

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
        is admitted (a burst sharing a system prompt: the first one's mark serves the rest, the
        others waiting for it while it is not reached: cache/prefix_wait.py); it
        checkpoints its state at `marks`; a kept state (prepared turn, keep=CHECKPOINT, labelled
        `final_label`) is named too. Deterministic requests neither look up nor mark: no
        checkpoint is canonical (they recompute in tiles, as on a miss)."""
        for choice in range(params.n):
            check_request_id(choice_id(request_id, choice), self.scheduler, self.caches.heads)
        if params.n > 1 and prefill_only:
            raise ValueError("a prefill-only request samples nothing: n must be 1")
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len, self.kv_layout)
        check_logit_bias(params, self.model_config.vocab_size)
        guide = None
        if params.constraint is not None:  # a bad schema is refused here, before anything runs
            guide = TokenGuide(self.grammars.matcher(params.constraint), self.model_config.vocab_size,
                               self._mask_threads)
        if params.deterministic and head is not None and head.canonical_window != self.config.deterministic.window:
            head = None  # the fast path made that state: recompute the whole prompt in tiles (a miss)
        check_prompt_logprobs(params, head)
        reuse = prefix_scope is not None and not params.deterministic and self.caches.heads.checkpoint_budget_bytes > 0
        if keep is KeepState.CHECKPOINT and not reuse:
            keep = KeepState.FREE
        request = Request(
            request_id,
            list(prompt_token_ids),
            seeded(params, prompt_token_ids),
            head=head,
            keep=keep,
            on_finished=on_finished,
            prefill_only=prefill_only,
            # a prepared turn's head is named (found by requests that do reuse) even with reuse off
            prefix_scope=prefix_scope if reuse or keep is KeepState.PREPARE else None,
            # prompt logprobs need every prompt row run here: no cached prefix (it still checkpoints)
            prefix_lookup=reuse and params.prompt_logprobs is None,
            marks=keyed_marks(prefix_scope, prompt_token_ids, marks) if reuse else (),
            final_label=final_label,
        )
        request.guide = guide
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = PromptLogprobs(request.prompt_token_ids, params.prompt_logprobs)
        # Choices 1..n-1 (workers/loop/forks.py): no head, no reuse, nothing kept: only choice 0's
        # state is committed or checkpointed; they fork from it when its prompt has run. Nor prompt
        # logprobs: the prompt is the group's, and choice 0 carries them.
        request.forks = [
            Request(choice_id(request_id, i), list(prompt_token_ids),
                    seeded(choice_params(params, i), prompt_token_ids), choice=i, group_id=request_id)
            for i in range(1, params.n)
        ]
        for choice in [request, *request.forks]:
            if params.constraint is not None and choice is not request:
                choice.guide = TokenGuide(self.grammars.matcher(params.constraint), self.model_config.vocab_size,
                                          self._mask_threads)
            if choice.guide is not None:
                choice.guide.prefetch(())  # the first mask, while the prompt runs
            self._finisher.start(choice)
        self.scheduler.add(request)
        return request

    def check_constraint(self, constraint) -> None:
        """Refuse (InvalidRequestError) a constraint whose reply cannot begin: its grammar allows
        no first token this model may produce, and an empty reply is not whole either (e.g. a
        regex opening with a character no token spells). Any thread: a fresh matcher, no engine
        state. Found here it is a 400 before anything runs; later in a reply, a dead end fails
        the request as the request's own doing (RequestOutput.error_invalid)."""
        guide = TokenGuide(self.grammars.matcher(constraint), self.model_config.vocab_size, self._mask_threads)
        check_constraint_starts(guide, self.banned_token_ids)

    def abort(self, request_id: str) -> None:
        """End a request, with every choice of it (n > 1) still running."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        choices = [r for r in self.scheduler.requests.values() if r.group_id == request_id]
        for choice in [request, *choices]:
            self._finisher.finish(choice, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        self.expire_prepared()
        outputs = self._fast_step.run()
        outputs += self._verify_step.run()
        self.verifier.metrics.step_seconds += time.perf_counter() - started
        return outputs

    def expire_prepared(self) -> int:
        """Abandon prepared states past their deadline (their owners never resolved them)."""
        return len(self.caches.heads.expire(time.monotonic()))

    def seconds_to_next_deadline(self) -> float | None:
        """How long an idle loop may sleep before `expire_prepared` has work (None: forever)."""
        deadline = self.caches.heads.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every unfinished request with an error (the loop itself failed)."""
        return [self._finisher.fail(r, message) for r in list(self.scheduler.requests.values())]

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

    def load(self) -> EngineLoad:
        """Its queue and measured speeds, for routing stats and heartbeats."""
        requests = self.scheduler.requests.values()
        forks = {f.request_id for r in requests for f in r.forks}  # n > 1: they will not prefill
        waiting = self.scheduler.unprefilled_tokens(skip=forks)
        return EngineLoad(len(requests), self.caches.kv.num_free, waiting, self._fast_step.prefill_rate.value,
                          self.scheduler.prefill_per_request.value, time.time(), self.kv_cache_usage())

    def withdrawn_prefixes(self) -> list[PrefixKey]:
        """Names of checkpoints evicted (or dropped) since the last call, no state holding them any
        more. Safe from any thread: it drains a deque the engine thread appends to."""
        withdrawn = self.caches.heads.withdrawn
        return [withdrawn.popleft() for _ in range(len(withdrawn))]

    def kv_cache_usage(self) -> float:
        """The fraction of KV blocks requests hold (blocks only heads and prefixes hold are
        evictable: free for this purpose, as vLLM counts its cached blocks)."""
        usage = self.caches.kv.usage()
        return usage.in_use / max(1, usage.total)

    def check_integrity(self) -> None:
        """free + cached + in use == total for blocks and slots, and nothing held by a request
        that is not admitted (run after every engine test; for debugging)."""
        self.caches.check_integrity()
        self.scheduler.check_integrity()
