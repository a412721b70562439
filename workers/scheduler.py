"""Continuous batching on plain Python state: which tokens of which requests run next.

Each step spends a token budget: running requests first (a decode costs 1 token, an
unfinished prefill continues in chunks), then waiting requests in queue order: by priority
(vLLM's `priority`, lower first), ties in arrival order (FCFS; with every priority at 0, the
default, the queue is plain FCFS). When KV blocks run out the most recently admitted running
request is preempted: its cache is freed and it re-enters the queue at the head of its
priority class, to be recomputed later (a Mamba state cannot be partially un-done, so
recompute is the only preemption mode).

Priority orders admission only, as vLLM's priority policy does: a running request is not
preempted for a waiting one of lower priority value, and, as in vLLM, nothing ages a waiting
request: a steady stream of lower values can keep a higher one waiting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.cache.coordinator import CacheCoordinator, PendingCopies
from workers.cache.prefix_wait import awaited_prefix
from workers.config import SchedulerConfig
from workers.load import Mean
from workers.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Run tokens [start, start + num_tokens) of a request; plain data for the runner."""

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]
    state_slot: int
    snapshot: tuple[int, int] | None = None  # (aligned position in (start, end], slot to copy the state to)
    # (position in (start, end], slot) of prefix checkpoint marks: prefill chunks only (a decode
    # row snapshots at most its aligned position)
    marks: tuple[tuple[int, int], ...] = ()

    @property
    def snapshots(self) -> tuple[tuple[int, int], ...]:
        """Every (position, slot) the Mamba state is copied to after that position."""
        return ((self.snapshot,) if self.snapshot is not None else ()) + self.marks

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the request's known tokens."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids[self.start : self.start + self.num_tokens]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: PendingCopies = field(default_factory=PendingCopies)
    preempted: list[str] = field(default_factory=list)
    unfittable: list[Request] = field(default_factory=list)  # cannot fit even alone: to be failed

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, caches: CacheCoordinator, align_tokens: int):
        self.config = config
        self.caches = caches
        self.align_tokens = align_tokens
        self.block_size = caches.kv.block_size
        # (state slot, aligned slot) of each running request, from its admission until it is
        # preempted or finishes (the only moves of a running request's slots): not looked up per step.
        self._slots: dict[str, tuple[int, int | None]] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # since the engine started (requests count their own too)
        self.tokens_run = 0  # tokens the fast path ran since the engine started (n > 1 runs a prompt once)
        self.prefill_per_request = Mean()  # tokens an admitted request computes: a queued request's cost (routing)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for choice in request.forks:  # neither waiting nor running until they fork (fork())
            self.requests[choice.request_id] = choice
        self.caches.register(request)
        self._enqueue(request, ahead_of_equals=False)

    def _enqueue(self, request: Request, *, ahead_of_equals: bool) -> None:
        """Into the waiting queue, kept sorted by priority: behind the requests of its priority
        (a new arrival) or ahead of them (a preempted request, which arrived before them)."""
        priority = request.params.priority
        place = len(self.waiting)
        while place > 0 and (self.waiting[place - 1].params.priority > priority or (
                ahead_of_equals and self.waiting[place - 1].params.priority == priority)):
            place -= 1
        self.waiting.insert(place, request)

    def unprefilled_tokens(self, skip: set[str]) -> int:
        """Prompt tokens its requests (but `skip`) have yet to compute, as the router prices a
        queue: a waiting request's prompt less the prefix it will start from, held now
        (coordinator.held_prefix_length) or computed for it by a running request's mark
        (prefix_wait.py). Counted whole, a loop's next step queued behind a long step made its
        replica look busy by the very history it holds, and the router sent the next one away."""
        marks = self.caches.open_marks
        waiting = {r.request_id for r in self.waiting}
        total = 0
        for r in self.requests.values():
            if r.request_id in skip:
                continue
            done = r.num_computed_tokens
            if r.request_id in waiting:
                done = max(done, self.caches.held_prefix_length(r), awaited_prefix(r, self.running, marks))
            total += max(0, r.num_prompt_tokens - done)
        return total

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def check_integrity(self) -> None:
        """The slots remembered per request are only running requests' (none kept for one that left)."""
        stray = set(self._slots) - {r.request_id for r in self.running}
        assert not stray, f"state slots remembered for requests not running: {stray}"

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING or request.verify_due:
                continue  # preempted earlier in this loop, or parked for a verify pass
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            table = self.caches.block_table(request)
            if len(table) * self.block_size < request.num_computed_tokens + n:  # most decode steps: no new block
                if not self._make_room(request, request.num_computed_tokens + n, out):
                    continue  # preempted itself; re-admission decides whether it can ever fit
                table = self.caches.block_table(request)
            out.chunks.append(self._chunk(request, n, table))
            budget -= n
        waiting_for_a_prefix: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            self.caches.attach_prefix(request)
            # a running request is about to checkpoint a prefix of it
            if awaited_prefix(request, self.running, self.caches.open_marks):
                waiting_for_a_prefix.append(self.waiting.popleft())
                continue
            start = request.head.state_len if request.head else request.num_computed_tokens
            n = request.num_tokens - start if request.deterministic else min(request.num_tokens - start, budget)
            idle = not self.running and not out.chunks and not out.preempted
            if out.preempted or not self.caches.try_admit(request, n, idle):
                if idle:
                    # Nothing runs, nothing was preempted, evictable heads are gone: it never fits.
                    out.unfittable.append(self.waiting.popleft())
                    continue
                break  # no room now; the queue keeps its order
            self.waiting.popleft()
            self.prefill_per_request.observe(request.num_tokens - start)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.deterministic:  # its prefill runs in verify tiles, outside the token budget
                request.verify_due = True
                continue
            out.chunks.append(self._chunk(request, n, self.caches.block_table(request)))
            budget -= n
        self.waiting.extendleft(reversed(waiting_for_a_prefix))  # still first in the queue
        out.copies = self.caches.pending.take()
        return out

    def _chunk(self, request: Request, n: int, table: list[int]) -> ScheduledChunk:
        start = request.num_computed_tokens
        snapshot = None
        slots = self._slots.get(request.request_id)
        if slots is None:  # admitted since its last chunk: the slots stay its own until it leaves running
            # A deterministic request's aligned slot is the verifier's (canonical states only).
            aligned = None if request.deterministic else self.caches.aligned_slot(request)
            slots = self._slots[request.request_id] = (self.caches.state_slot(request), aligned)
        state_slot, aligned_slot = slots
        if aligned_slot is not None:
            aligned = (start + n) // self.align_tokens * self.align_tokens
            if aligned > start:
                snapshot = (aligned, aligned_slot)
        marks = ()
        if request.marks and not request.deterministic and (n > 1 or start == 0):
            marks = tuple(self.caches.marks_in(request, start, start + n))
        return ScheduledChunk(request, start, n, list(table), state_slot, snapshot, marks)

    def fork(self, parent: Request, child: Request) -> PendingCopies | None:
        """Choice `child` of `parent`'s group runs on from the parent's state (its prompt just
        ran): the copies to make now. Without room it queues and computes its prompt itself
        (None), as a preempted request does."""
        parent.forks.remove(child)
        copies = self.caches.fork_request(parent, child)
        if copies is None:
            self._enqueue(child, ahead_of_equals=True)
            return None
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return copies

    def _make_room(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        while not self.caches.can_grow(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return False
        self.caches.grow(request, num_tokens)
        return True

    def _preempt(self, request: Request) -> None:
        self._slots.pop(request.request_id, None)
        self.running.remove(request)
        self.caches.release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.drop_unverified()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, ahead_of_equals=True)

    def advance(self, output: SchedulerOutput) -> None:
        """Move the counters of everything that just ran (before new tokens are appended)."""
        for chunk in output.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
            self.tokens_run += chunk.num_tokens
            # The fast path wrote state past the last verify pass: until another pass commits,
            # nothing this request holds may be labelled canonical.
            chunk.request.tile_window = 0
            if chunk.snapshot is not None:
                chunk.request.aligned_len = chunk.snapshot[0]
            if chunk.request.marks and self.caches.open_marks(chunk.request.request_id):
                self.caches.reach_marks(chunk.request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Stop a request wherever it is: waiting, running or mid-prefill."""
        if request.is_finished:
            return
        self._slots.pop(request.request_id, None)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:  # an unfittable request has already left the queue
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self.caches.finish(request, completed=reason in (FinishReason.STOP, FinishReason.LENGTH))
