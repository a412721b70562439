"""asyncio front of the engine: the engine loop runs on one thread, callers await streams.

Everything that touches engine state (adding, aborting, conversation publish/discard,
export) runs on the engine thread between steps, submitted through `call`, so the
scheduler and caches are never touched concurrently and the event loop never blocks on
a model step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from workers.engine import LLMEngine, RequestOutput
from workers.sampling import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- public API ------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps and return its result."""
        future: Future = Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

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

    async def stream(self, request_id: str, start: Callable[[LLMEngine], Any]) -> AsyncIterator[RequestOutput]:
        """Run start(engine) on the engine thread (it adds request_id, e.g. a conversation
        turn) and stream that request's outputs; leaving early aborts it."""
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        try:
            await self.call(start)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                out: RequestOutput = await outputs.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: e.abort(request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put((lambda e: None, Future()))  # wake the loop
        self._thread.join(timeout=30)

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            self._run_commands(block)
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug outside the model step: fail every request, keep the loop
                log.exception("engine step crashed")
                outputs = self.engine.fail_all(f"engine step crashed: {e}")
            for out in outputs:
                self._deliver(out)

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:  # handed to the awaiting caller
                    future.set_exception(e)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is not None:
            loop, outputs = target
            loop.call_soon_threadsafe(outputs.put_nowait, out)
