"""The ingress's turns in flight: admitted against max_inflight, observed for the metrics,
and settled once however they end.

    InFlight.start(make)       counts the request in (503 when full), makes its TurnRequest
                               (a bad one is a counted 4xx), starts its TurnRun and waits for the
        -> StartedTurn         first event (a failure before it is raised, counted)
        -> HeadMoved           not counted: the caller plans again (responses_plan.start_turn)
    StartedTurn.collect()      the whole turn, for a JSON answer
    StartedTurn.relay(stream)  the turn as SSE chunks
    StartedTurn.settle(status) the one way out: counted out with its status, then run.close()
                               (the worker's run cancelled unless done, the lease settled)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from ray.serve.handle import DeploymentHandle

from cache_service.client import CacheClient
from deployments import errors
from deployments.errors import APIError
from deployments.front.metrics import ServeMetrics, turn_range
from deployments.front.streams import EventStream
from deployments.messages import Recovery, TurnDelta, TurnDone, TurnEvent, TurnFailed
from deployments.settings import AppSettings
from deployments.turn.lease_keeper import LeaseKeeper
from deployments.turn.request import HeadMoved, TurnRequest
from deployments.turn.run import TurnRun, first_error

CUT_SHORT = 499  # a streamed turn whose client went away before the end


def _status(error: BaseException) -> int:
    return error.status if isinstance(error, APIError) else 500


class InFlight:
    """The ingress's count of requests in flight, and the turns it starts."""

    def __init__(self, settings: AppSettings, workers: DeploymentHandle, metrics: ServeMetrics,
                 cache: Callable[[], Awaitable[CacheClient]]):
        self.settings, self.workers, self.metrics, self._cache = settings, workers, metrics, cache
        self._keeper: LeaseKeeper | None = None  # made with the cache service's client
        self._count = 0

    def connected(self, client: CacheClient) -> None:
        self._keeper = LeaseKeeper(client.target, client.config, on_delay=self.metrics.lease_renewal_delay,
                                   on_renewal=self.metrics.lease_renewal_rpc)

    async def start(self, make: Callable[[], TurnRequest], arrived: float) -> StartedTurn | HeadMoved:
        """Count the request in and start its turn (`make()`, called once the request is counted:
        a bad one is a counted 4xx) up to its first event."""
        if self._count >= self.settings.max_inflight:
            raise errors.overloaded("too many requests in flight")
        self._count += 1
        self.metrics.queue_depth.inc()
        self.metrics.vllm.waiting.inc()
        try:
            run = await TurnRun.start(self.settings, self.workers, await self._cache(), self._keeper, make())
        except BaseException as e:
            self.finished(_status(e))
            if isinstance(e, APIError) and e.code == "conversation_busy":
                self.metrics.lease_conflicts.inc()
            raise
        if isinstance(run, HeadMoved):  # nothing ran: not a request of its own
            self._count -= 1
            self.metrics.queue_depth.dec()
            self.metrics.vllm.waiting.dec()
            return run
        turn = StartedTurn(self, run, arrived)
        await turn.begin()
        return turn

    def finished(self, status: int, running: bool = False) -> None:
        self._count -= 1
        self.metrics.queue_depth.dec()
        (self.metrics.vllm.running if running else self.metrics.vllm.waiting).dec()
        self.metrics.requests.labels(str(status)).inc()


class _Settling:
    """`async with`: the turn settled on the way out, with `status` as it stands then."""

    def __init__(self, turn: StartedTurn, status: int):
        self.turn, self.status = turn, status

    async def __aenter__(self) -> _Settling:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.turn.settle(self.status)


class StartedTurn:
    """A counted-in turn whose worker has answered (or will, from the ledger); `settle` ends it."""

    def __init__(self, gate: InFlight, run: TurnRun, arrived: float):
        self.run, self._gate, self._arrived = run, gate, arrived
        self._first: TurnEvent | None = None
        self._events: AsyncIterator[TurnEvent] = run.events()
        self._running = False  # streaming tokens (vllm:num_requests_running), else waiting
        self._first_token: float | None = None

    @property
    def turn(self) -> int | None:
        """This turn's number in its conversation (None: a stateless request)."""
        return self.head_turn + 1 if self.run.job.conversation is not None else None

    @property
    def head_turn(self) -> int:
        """The conversation's head turn the turn follows (0: a new conversation, or stateless; an
        answered retry's: the one its first run followed)."""
        return self.run.base_turn

    async def begin(self) -> None:
        """Wait for the first event; a failure is raised, the turn settled."""
        try:
            self._first = await anext(self._events)
        except BaseException as e:
            await self.settle(_status(e))
            raise
        error = first_error(self._first)
        if error is not None:
            await self.settle(error.status)
            raise error

    async def settle(self, status: int) -> None:
        # counted out first: a second cancellation may interrupt the await below
        self._gate.finished(status, self._running)
        await self.run.close()

    async def collect(self) -> tuple[list[str], list[list], tuple | None, TurnDone]:
        """The whole turn: its text and logprobs by choice (n > 1: index i at i), its prompt
        logprobs (if asked; the prompt is every choice's) and TurnDone (the tool calls come whole
        with it)."""
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list] = {}
        prompt = None
        async with _Settling(self, 500) as settling:
            async for event in self._observed():
                if isinstance(event, TurnFailed):
                    error = first_error(event)
                    settling.status = error.status
                    raise error
                if isinstance(event, TurnDelta):
                    texts.setdefault(event.index, []).append(event.text)
                    logprobs.setdefault(event.index, []).extend(event.logprobs or ())
                    prompt = event.prompt_logprobs or prompt
            settling.status = 200
        choices = range(1 + len(event.others))
        return ["".join(texts.get(i, ())) for i in choices], [logprobs.get(i, []) for i in choices], prompt, event

    async def relay(self, stream: EventStream) -> AsyncIterator[str]:
        """The turn's events as `stream` renders them (SSE)."""
        async with _Settling(self, CUT_SHORT) as settling:
            for chunk in stream.start():
                yield chunk
            async for event in self._observed():
                if isinstance(event, TurnFailed):
                    error = first_error(event)
                    settling.status = error.status
                    for chunk in stream.error(error):
                        yield chunk
                    return
                if isinstance(event, TurnDelta):
                    for chunk in stream.delta(event):
                        yield chunk
            for chunk in stream.end(event):
                yield chunk
            settling.status = 200

    async def _observed(self) -> AsyncIterator[TurnEvent]:
        """The turn's events from the first on, observed for the metrics: TurnDelta*, then its
        TurnDone or TurnFailed (the last one)."""
        event, last = self._first, None
        while True:
            last = self._observe(event, last)
            if isinstance(event, TurnDone):
                self._done(event)
            yield event
            if isinstance(event, (TurnDone, TurnFailed)):
                return
            event = await anext(self._events)

    def _observe(self, event: TurnEvent, last: float | None) -> float | None:
        """Token timings and counts; returns when the latest token came (None: none yet)."""
        metrics = self._gate.metrics
        if isinstance(event, TurnDelta) and event.token_ids:
            now = time.monotonic()
            if last is None:
                metrics.ttft.labels(turn_range(self.turn)).observe(now - self._arrived)
                metrics.vllm.ttft.observe(now - self._arrived)
                self._first_token = now
                if not self._running:
                    self._running = True
                    metrics.vllm.waiting.dec()
                    metrics.vllm.running.inc()
            else:
                metrics.itl.observe(now - last)
                metrics.vllm.itl.observe(now - last)
            metrics.output_tokens.inc(len(event.token_ids))
            metrics.vllm.generation_tokens.inc(len(event.token_ids))
            return now
        if isinstance(event, TurnDone):
            metrics.prompt_tokens.inc(event.prompt_tokens)
        return last

    def _done(self, done: TurnDone) -> None:
        if done.recovery is Recovery.REPLAY:  # answered from the ledger: counted when it ran
            return
        self._gate.metrics.vllm.finished(done, arrived=self._arrived, first_token=self._first_token,
                                         now=time.monotonic())
        head, messages = self.run.job.head, self.run.job.messages
        self._gate.metrics.turn_done(continued=head is not None, cached_tokens=done.cached_tokens,
                                     recovery=done.recovery, moved=head is not None and head.owner != done.replica,
                                     reused_from=done.reused_from,
                                     tool_resume=bool(messages) and messages[-1]["role"] == "tool",
                                     tool_calls=len(done.tool_calls))
