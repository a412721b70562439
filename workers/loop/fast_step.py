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
        # n > 1 (forks.py): a prompt's end also samples its other choices, from its own row.
        forks = [(row, choice) for row in rows for choice in ending[row].request.forks]
        requests = [ending[i].request for i in rows] + [choice for _, choice in forks]
        rows += [row for row, _ in forks]
        masks, grammar_failed = grammar_masks(requests, self.banned_token_ids)
        started = time.perf_counter()
        try:
            logits = self.runner.execute(step)
            sampled = sample(
                logits[rows] if rows != list(range(len(ending))) else logits,
                [r.params for r in requests],
                [r.num_tokens for r in requests],
                self.banned_token_ids,
                overwrite=True,  # the step's own logits (or a copy of rows): mask the never-sampled ids in place
                allowed=masks,
                histories=[TokenHistory(r.prompt_token_ids, r.output_token_ids)
                           if r.params.processes else None for r in requests],
                eos_token_ids=finisher.eos_token_ids,
            )
        except Exception as e:  # a failing step fails its requests; the engine keeps serving
            log.exception("model step failed")
            return outputs + [finisher.fail(c.request, f"model step failed: {e}") for c in step.chunks]
        tokens = sum(c.num_tokens for c in step.chunks)
        if tokens - len(step.chunks) >= MIN_PREFILL_TOKENS:  # more than one token per row: a prefill ran
            self.prefill_rate.observe(tokens, time.perf_counter() - started)
        self.scheduler.advance(step)
        for row, choice in forks:  # before choice 0's token, which may end it and free its tail
            copies = self.scheduler.fork(ending[row].request, choice)
            if copies is not None:
                self.runner.apply_copies(copies)
        for request, token in zip(requests, sampled):
            if grammar_failed.get(request.request_id) == COMPLETE:
                finisher.finish(request, FinishReason.STOP)
                outputs.append(output_of(request, (), ""))
            elif request.request_id in grammar_failed:  # the request's constraint leads nowhere: its doing
                outputs.append(finisher.fail(request, grammar_failed[request.request_id], invalid=True))
            elif request.deterministic:  # a candidate: nothing reaches the client unverified
                self.verifier.on_candidate(request, token, finisher.ends)
                prefetch_mask(request)
            else:
                outputs.append(finisher.on_token(request, token))
        for chunk in ending:
            if chunk.request.prefill_only:  # its state now covers the whole prompt: done
                finisher.finish(chunk.request, FinishReason.STOP)
                outputs.append(output_of(chunk.request, (), ""))
        return outputs
