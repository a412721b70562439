"""The fast step: one batch of prefill chunks and decodes through the model, sampled (masked
by constrained requests' grammars), its tokens handed to the finisher or, for deterministic
requests, to the verifier as candidates."""

from __future__ import annotations

import logging
import time

import torch

from workers.deterministic.verifier import Verifier
from workers.loop.finishing import Finisher
from workers.loop.grammar_masks import COMPLETE, grammar_masks, prefetch_mask
from workers.load import MIN_PREFILL_TOKENS, Rate
from workers.loop.outputs import RequestOutput, output_of
from workers.request import FinishReason
from workers.runner import ModelRunner
from workers.logits_processors import TokenHistory
from workers.sampling import sample
from workers.scheduler import Scheduler

log = logging.getLogger(__name__)


class FastStep:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        verifier: Verifier,
        finisher: Finisher,
        banned_token_ids: torch.Tensor,
    ):
        self.scheduler = scheduler
        self.runner = runner
        self.verifier = verifier
        self.finisher = finisher
        self.banned_token_ids = banned_token_ids
        # Tokens/s of steps that prefill: what the router prices a replica's missing prefix at.
        self.prefill_rate = Rate()

    @torch.inference_mode()  # the step's logits are masked in place before sampling
    def run(self) -> list[RequestOutput]:
        finisher = self.finisher
        step = self.scheduler.schedule()
        outputs = [finisher.fail(r, "the request does not fit in the KV cache") for r in step.unfittable]
        if not step.chunks:
            # Admitted deterministic prefills run no chunk, but their slots must be zeroed
            # (or copied from a head) before their first verify pass reads them.
            self.runner.apply_copies(step.copies)
            return outputs
        ending = [c for c in step.chunks if c.samples]
        rows = [i for i, c in enumerate(ending) if not c.request.prefill_only]
        sampling = [ending[i] for i in rows]
        masks, grammar_failed = grammar_masks([c.request for c in sampling], self.banned_token_ids)
        started = time.perf_counter()
        try:
            logits = self.runner.execute(step)
            sampled = sample(
                logits[rows] if len(rows) != len(ending) else logits,
                [c.request.params for c in sampling],
                [c.request.num_tokens for c in sampling],
                self.banned_token_ids,
                overwrite=True,  # the step's own logits: mask the never-sampled ids in place
                allowed=masks,
                histories=[TokenHistory(c.request.prompt_token_ids, c.request.output_token_ids)
                           if c.request.params.processes else None for c in sampling],
                eos_token_ids=finisher.eos_token_ids,
            )
        except Exception as e:  # a failing step fails its requests; the engine keeps serving
            log.exception("model step failed")
            return outputs + [finisher.fail(c.request, f"model step failed: {e}") for c in step.chunks]
        tokens = sum(c.num_tokens for c in step.chunks)
        if tokens - len(step.chunks) >= MIN_PREFILL_TOKENS:  # more than one token per row: a prefill ran
            self.prefill_rate.observe(tokens, time.perf_counter() - started)
        self.scheduler.advance(step)
        for chunk, token in zip(sampling, sampled):
            if grammar_failed.get(chunk.request.request_id) == COMPLETE:
                finisher.finish(chunk.request, FinishReason.STOP)
                outputs.append(output_of(chunk.request, (), ""))
            elif chunk.request.request_id in grammar_failed:
                outputs.append(finisher.fail(chunk.request, grammar_failed[chunk.request.request_id]))
            elif chunk.request.deterministic:  # a candidate: nothing reaches the client unverified
                self.verifier.on_candidate(chunk.request, token, finisher.ends)
                prefetch_mask(chunk.request)
            else:
                outputs.append(finisher.on_token(chunk.request, token))
        for chunk in ending:
            if chunk.request.prefill_only:  # its state now covers the whole prompt: done
                finisher.finish(chunk.request, FinishReason.STOP)
                outputs.append(output_of(chunk.request, (), ""))
        return outputs
