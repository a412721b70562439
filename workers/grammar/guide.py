"""One constrained request's matcher: which tokens it may sample next.

The mask at a position is a pure function of the reply's tokens before it (the matcher is
brought to exactly those tokens: rolled back to the common prefix, then fed the rest), so a
deterministic request's verify pass draws under the same masks as a replay, a preempted
request recomputes the same ones, and another replica computes them again bit for bit.

Off the engine thread: after each sampled token the next mask is computed on a worker thread
(llguidance releases the GIL) while the model runs the next step; the sampler then only
waits for it. A token the grammar refuses (a deterministic request's injected mismatch) ends
the masks there: what is drawn after it is thrown away by the rollback anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from workers.errors import EngineError


class GrammarError(EngineError):
    """The matcher failed (a parser limit, an internal error): its request fails alone."""


class TokenGuide:
    def __init__(self, matcher, vocab_size: int, executor: ThreadPoolExecutor | None):
        """executor: where `prefetch` computes masks (None: a guide that never prefetches)."""
        self._matcher = matcher
        self._vocab = vocab_size
        self._executor = executor
        self._consumed: list[int] = []  # the tokens the matcher is at
        self._pending: tuple[tuple[int, ...], Future] | None = None

    def allowed(self, generated: Sequence[int]) -> torch.Tensor | None:
        """Bool [vocab]: the tokens allowed after `generated` (None: no constraint applies)."""
        key = tuple(generated)
        pending, self._pending = self._pending, None
        if pending is not None:
            tokens, future = pending
            mask = future.result()  # also: the matcher is free again
            if tokens == key:
                return mask
        return self._mask_after(key)

    def prefetch(self, generated: Sequence[int]) -> None:
        """Start computing the mask after `generated` on a worker thread."""
        key = tuple(generated)
        if self._pending is not None:
            if self._pending[0] == key:
                return
            self._pending[1].result()
        self._pending = (key, self._executor.submit(self._mask_after, key))

    def ended_after(self, generated: Sequence[int]) -> bool:
        """Whether the grammar is complete after `generated` (nothing more may follow): the reply
        ends there, whether or not the model may sample its end-of-turn token."""
        self._settle()
        return self._sync(tuple(generated)) and self._matcher.is_stopped()

    def accepts(self, generated: Sequence[int]) -> bool:
        """Whether the grammar accepts the reply as it is after `generated` (it may end there)."""
        self._settle()
        return self._sync(tuple(generated)) and self._matcher.is_accepting()

    def _settle(self) -> None:
        if self._pending is not None:
            self._pending[1].result()
            self._pending = None

    def masks_after(self, generated: Sequence[int], counts: Sequence[int]) -> list[torch.Tensor | None]:
        """For each count c, the mask after generated[:c] (None where c is out of range): the
        positions of a verify pass's tile."""
        self._settle()
        return [self._mask_after(tuple(generated[:c])) if 0 <= c <= len(generated) else None for c in counts]

    def _sync(self, tokens: tuple[int, ...]) -> bool:
        """Bring the matcher to exactly `tokens`; False if the grammar refuses one of them (the
        matcher then stands at the tokens before it)."""
        matcher, done = self._matcher, self._consumed
        common = 0
        for a, b in zip(done, tokens):
            if a != b:
                break
            common += 1
        if common < len(done):
            matcher.rollback(len(done) - common)
            del done[common:]
        rest = list(tokens[common:])
        if rest:
            accepted = matcher.validate_tokens(rest)
            if accepted and not matcher.consume_tokens(rest[:accepted]):
                return False
            done.extend(rest[:accepted])
            if accepted < len(rest):
                return False
        return not matcher.is_error()

    def _mask_after(self, tokens: tuple[int, ...]) -> torch.Tensor | None:
        matcher = self._matcher
        if not self._sync(tokens):  # refused: nothing after it is constrained (or kept)
            return None
        bias = matcher.compute_logit_bias()
        if matcher.is_error():  # its mask would allow only the end of the reply: never a silent "stop"
            raise GrammarError(f"the grammar failed: {matcher.get_error()}")
        mask = torch.frombuffer(bytearray(bias), dtype=torch.uint8)[: self._vocab].bool()
        if mask.numel() < self._vocab:
            mask = torch.cat([mask, torch.zeros(self._vocab - mask.numel(), dtype=torch.bool)])
        return mask

    def close(self) -> None:
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None
