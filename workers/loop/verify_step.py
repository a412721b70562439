"""The verify step (deterministic mode, workers/deterministic): verify passes of G requests each
for every deterministic request waiting for one; only what they accept goes through the stop
checks to the detokenizer and the stream."""

from __future__ import annotations

import logging

from workers.deterministic.verifier import Verifier
from workers.loop.finishing import Finisher
from workers.loop.outputs import RequestOutput, output_of
from workers.request import FinishReason
from workers.scheduler import Scheduler

log = logging.getLogger(__name__)


class VerifyStep:
    def __init__(self, scheduler: Scheduler, verifier: Verifier, finisher: Finisher, rows: int):
        self.scheduler = scheduler
        self.verifier = verifier
        self.finisher = finisher
        self.rows = rows  # requests per verify pass

    def run(self) -> list[RequestOutput]:
        due = [r for r in self.scheduler.running if r.verify_due]
        outputs: list[RequestOutput] = []
        for i in range(0, len(due), self.rows):
            group = due[i : i + self.rows]
            try:
                verdicts = self.verifier.verify(group)
            except Exception as e:  # as a failing model step: its requests fail, the engine goes on
                log.exception("verify pass failed")
                outputs += [self.finisher.fail(r, f"verify pass failed: {e}") for r in group]
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
                    text, reason = self.finisher.text_and_reason(request, token)
                    delta += text
                    if reason is not None:
                        break
                applied.append((request, taken, delta, reason))
            self.verifier.commit(verdicts, [len(taken) for _, taken, _, _ in applied])
            for request, taken, delta, reason in applied:
                if reason is not None:
                    delta += self.finisher.flush(request)
                    self.finisher.finish(request, reason)
                if taken or request.is_finished:
                    outputs.append(output_of(request, taken, delta))
        return outputs
