"""asyncio front of the engine: the engine loop runs on one thread, callers await streams.

Everything that touches engine state (adding, aborting, conversation commit/abandon,
export snapshots) runs on the engine thread between steps, submitted through `call`, so the
scheduler and caches are never touched concurrently and the event loop never blocks on
a model step. Commands run in submission order.

Failure containment: a caller that vanished (its event loop closed) loses only its own
request, which is aborted; `shutdown()` fails every pending stream and call with
`EngineShutdownError` instead of leaving them unresolved.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from workers.engine import LLMEngine, RequestOutput
from workers.errors import EngineShutdownError, RequestIdInUseError
from workers.load import EngineLoad
from workers.sampling import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")

# How old the engine's load snapshot may get while it runs (its reports go out every second).
LOAD_EVERY_S = 0.2


@dataclass(frozen=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # RequestOutput, or an exception that ends the stream

    def put(self, item: RequestOutput | BaseException) -> None:
        """From any thread; raises RuntimeError if the caller's loop is closed."""
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._closed = False
        self._submit_lock = threading.Lock()  # `call` vs `shutdown`: nothing is queued after the drain
        # The engine's queue, speeds and KV usage as of a recent pause between steps (at most
        # LOAD_EVERY_S old while it runs), for routing stats: read from any thread without waiting
        # for a step (a long prefill step held every report past Serve's 5 s timeout, and the
        # router priced the one before).
        self.load: EngineLoad = engine.load()
        self._load_due = 0.0
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- public API ------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self._submit(fn))

    def _submit(self, fn: Callable[[LLMEngine], Any]) -> Future:
        future: Future = Future()
        with self._submit_lock:
            if self._closed:
                future.set_exception(EngineShutdownError("the engine was shut down"))
            else:
                self._commands.put((fn, future))
        return future

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        **add_kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iterator early aborts the request."""
        request_id = request_id or f"req-{next(self._ids)}"
        start = lambda e: e.add_request(request_id, prompt_token_ids, params, **add_kwargs)  # noqa: E731
        async for out in self.stream(request_id, start):
            yield out

    async def stream(self, request_id: str, start: Callable[[LLMEngine], Any],
                     on_left: Callable[[LLMEngine], Any] | None = None) -> AsyncIterator[RequestOutput]:
        """Run start(engine) on the engine thread (it adds request_id, e.g. a conversation
        turn) and stream that request's outputs; leaving early aborts it. If start returns
        None it started nothing (e.g. a head that is already held) and the stream is empty.

        `on_left(engine)` runs on the engine thread after that abort: the request may have
        finished before the abort reached it (its last output unread, or crossing the abort),
        and what it left for its caller (a prepared turn) has no owner any more.

        Raises RequestIdInUseError if request_id is already streaming (that stream is untouched)."""
        if request_id in self._streams:
            raise RequestIdInUseError(f"request id {request_id!r} is already streaming")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        try:
            started = await self.call(start)
        except asyncio.CancelledError:
            # start may still be running on the engine thread: abort whatever it adds. Commands
            # run in order, so this runs after it (not awaited: this caller is being cancelled).
            self._forget(request_id, stream)
            self._left(request_id, on_left)
            raise
        except BaseException:
            self._forget(request_id, stream)
            raise
        if started is None:
            self._forget(request_id, stream)
            return
        finished = False
        ended: set[int] = set()  # choices (n > 1) that finished: the stream ends with the last one
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine is gone: nothing left to abort
                    raise item
                if item.finished:
                    ended.add(item.index)
                # a failed choice fails the group: leaving the stream aborts the others
                finished = len(ended) == item.choices or (item.finished and item.error is not None)
                yield item
        finally:
            self._forget(request_id, stream)
            if not finished:
                self._left(request_id, on_left)

    def _left(self, request_id: str, on_left: Callable[[LLMEngine], Any] | None) -> None:
        """Abort a request whose stream was left, then `on_left` (commands run in order; not
        awaited: the caller may be cancelled)."""
        self._submit(lambda e: e.abort(request_id))
        if on_left is not None:
            self._submit(on_left)

    def _forget(self, request_id: str, stream: _Stream) -> None:
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: e.abort(request_id))

    def check_alive(self) -> None:
        if not self._thread.is_alive() and not self._closed:
            raise EngineShutdownError("the engine loop thread died")

    def shutdown(self) -> None:
        """Stop the loop, fail what is still running or queued, resolve every stream and call."""
        with self._submit_lock:
            self._closed = True
            self._stop.set()
            self._commands.put((lambda e: None, Future()))  # wake the loop
        self._thread.join(timeout=60)
        error = EngineShutdownError("the engine was shut down")
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        if not self._thread.is_alive():  # the engine is ours now: release its requests' state
            self.engine.fail_all("the engine was shut down")
        for request_id, stream in list(self._streams.items()):
            self._streams.pop(request_id, None)
            try:
                stream.put(error)
            except RuntimeError:
                log.info("stream %s: its event loop is closed", request_id)

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            self._run_commands(block=idle, timeout=self.engine.seconds_to_next_deadline() if idle else None)
            self.engine.expire_prepared()
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug outside the model step: fail every request, keep the loop
                log.exception("engine step crashed")
                outputs = self.engine.fail_all(f"engine step crashed: {e}")
            for out in outputs:
                self._deliver(out)
            self._take_load()

    def _take_load(self) -> None:
        """Refresh `load` once the engine is idle, else at most every LOAD_EVERY_S (it walks every
        block table: not each decode step's cost)."""
        now = time.monotonic()
        if now >= self._load_due or not self.engine.has_unfinished():
            self._load_due = now + LOAD_EVERY_S
            try:
                self.load = self.engine.load()
            except Exception:  # a report is not worth the loop: the last one stands
                log.exception("engine load snapshot failed")

    def _run_commands(self, block: bool, timeout: float | None) -> None:
        try:
            fn, future = self._commands.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(self.engine)
                except BaseException as e:  # handed to the awaiting caller
                    future.set_exception(e)
                else:
                    self._take_load()  # before its caller can read the load
                    future.set_result(result)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.stream_id)  # every choice of a request streams under its id
        if stream is None:
            return
        try:
            stream.put(out)
        except RuntimeError:  # the caller's event loop is closed: only its request ends
            log.warning("request %s: its caller is gone; aborting it", out.stream_id)
            self._forget(out.stream_id, stream)
            self.engine.abort(out.stream_id)
