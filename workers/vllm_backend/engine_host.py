"""The worker's side of the engine host: starts `hybridserve_vllm.host` in the vLLM environment
and speaks its frames (host/hybridserve_vllm/wire.py) over the child's stdin and stdout.

Everything here runs on the worker's event loop. A request's frames go to its stream; a call's
reply to its future. A stream left before its request finished aborts the request, and a turn
captured meanwhile (its end crossed the abort) is abandoned: the host keeps nothing nobody owns.
If the host dies, every stream and call fails with EngineShutdownError.

A host can also hang without dying (a wedged kernel, a deadlock in the engine): its turns would
wait forever and its replica would look healthy. So a watchdog kills a host that has work in hand
(a request streaming, a call awaiting its reply) and sends nothing for `stall_timeout_s`: a busy
host sends a frame at least every second (a token, or a tick while a long prompt is prefilled),
a call is answered between two steps. Its turns then fail with EngineShutdownError (503) and the
replica's health check fails (Serve replaces it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.errors import EngineShutdownError
from workers.vllm_backend.host.hybridserve_vllm import wire
from workers.vllm_backend.venv import VENV_DIR

log = logging.getLogger("hybridserve.vllm")

HOST_DIR = Path(__file__).resolve().parent / "host"
START_TIMEOUT_S = 600.0  # loading the model and profiling its memory, on a loaded machine


def vllm_interpreter(configured: str = "") -> str:
    """The Python of the environment with vLLM: the app's setting, else $HYBRIDSERVE_VLLM_PYTHON,
    else the repo's venv (made by `python -m workers.vllm_backend.venv`), else this one (an
    image where vLLM shares our environment)."""
    if configured:
        return configured
    if os.environ.get("HYBRIDSERVE_VLLM_PYTHON"):
        return os.environ["HYBRIDSERVE_VLLM_PYTHON"]
    venv_python = VENV_DIR / "bin" / "python"
    return str(venv_python) if (VENV_DIR / ".ready").exists() else sys.executable


@dataclass(frozen=True)
class HostSettings:
    model: str
    python: str = ""
    device: str = "cpu"
    max_model_len: int = 0
    max_num_seqs: int = 16
    kv_cache_mib: int = 256
    threads: int = 1
    stall_timeout_s: float = 120.0  # longer than any one engine step (one chunk of a prompt's prefill)


class EngineHost:
    def __init__(self, settings: HostSettings):
        self.settings = settings
        self.info: dict[str, Any] = {}
        self._process: asyncio.subprocess.Process | None = None
        self._started: asyncio.Task | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._parts: dict[int, list[bytes]] = {}  # call -> the parts of its reply received so far
        self._orphans: set[str] = set()  # requests whose stream was left before their end
        self._numbers = itertools.count()
        self._failure: str | None = None
        self._heard_at = 0.0  # the loop's time of the host's latest frame, or of work given to an idle host
        self._watchdog: asyncio.Task | None = None

    async def start(self) -> dict[str, Any]:
        """Start the host (once; later calls wait for the same start); returns its info."""
        await asyncio.shield(self.start_soon())
        return self.info

    def start_soon(self) -> asyncio.Task:
        """The host's start, begun if it was not."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        return self._started

    @property
    def ready(self) -> bool:
        return bool(self.info) and self._failure is None

    async def _start(self) -> None:
        s = self.settings
        argv = [vllm_interpreter(s.python), "-m", "hybridserve_vllm.host", "--model", s.model,
                "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
                "--kv-cache-mib", str(s.kv_cache_mib), "--dtype", "float32" if s.device == "cpu" else "auto"]
        env = {
            **os.environ,
            "PYTHONPATH": str(HOST_DIR),  # the host package only: ours is not installed there
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            # CPU: the replica's share of the cores (torch_threads), not the whole machine.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(s.threads),
        }
        try:
            self._process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, limit=1 << 20)
        except OSError as e:
            self._failure = f"cannot start the vLLM engine host with {argv[0]}: {e}"
            raise EngineShutdownError(self._failure) from e
        try:
            first = await asyncio.wait_for(self._read(), START_TIMEOUT_S)
        except TimeoutError:
            first = {"error": f"not ready after {START_TIMEOUT_S:.0f} s"}
        if first is None or first.get("op") != "ready":
            why = (first or {}).get("error", "the engine host exited while starting")
            self._failure = f"vLLM engine host did not start: {why}"
            self.shutdown()
            raise EngineShutdownError(self._failure)
        self.info = first["info"]
        dispatch = asyncio.ensure_future(self._dispatch())
        dispatch.add_done_callback(lambda task: self._fail(
            f"the vLLM engine host's frames could not be read: {task.exception()!r}")
            if not task.cancelled() and task.exception() else None)
        self._watchdog = asyncio.ensure_future(self._watch())

    async def _read(self) -> dict[str, Any] | None:
        try:
            header = await self._process.stdout.readexactly(wire.HEADER_BYTES)
            message = wire.decode(await self._process.stdout.readexactly(wire.body_length(header)))
        except asyncio.IncompleteReadError:
            return None
        self._heard_at = asyncio.get_running_loop().time()
        return message

    def _has_work(self) -> bool:
        return bool(self._streams or self._calls or self._orphans)

    def _giving_work(self) -> None:
        """Call before registering a stream or call: an idle host's silence so far was not a stall."""
        if not self._has_work():
            self._heard_at = asyncio.get_running_loop().time()

    async def _watch(self) -> None:
        """Kills the host once it has work in hand and has sent nothing for stall_timeout_s."""
        limit = self.settings.stall_timeout_s
        loop = asyncio.get_running_loop()
        silent_before = False
        while self._failure is None:
            await asyncio.sleep(min(limit / 4, 5.0))
            silent = loop.time() - self._heard_at
            stalled = self._has_work() and silent > limit
            # Twice in a row: after this loop itself was held up, frames already in the pipe are
            # read only after this check runs; the next one sees them.
            if stalled and silent_before and self._failure is None:
                self._fail(f"the vLLM engine host sent nothing for {silent:.0f} s with {len(self._streams)} "
                           f"requests and {len(self._calls)} calls in hand: stuck, killed")
                log.error("%s", self._failure)
                self.shutdown()
            silent_before = stalled

    async def _dispatch(self) -> None:
        while (message := await self._read()) is not None:
            if message["op"] == "out":
                self._deliver(message)
            elif message["op"] == "part":  # a piece of a reply to come (a head's export)
                if message["call"] in self._calls:
                    self._parts.setdefault(message["call"], []).append(message["data"])
            elif message["op"] == "reply":
                message["parts"] = self._parts.pop(message["call"], [])
                future = self._calls.pop(message["call"], None)
                if future is not None and not future.done():
                    future.set_result(message)
        self._fail("the vLLM engine host exited")  # at once: nothing may wait on it any more
        log.error("the vLLM engine host exited with %s", await self._process.wait())

    def _deliver(self, frame: dict[str, Any]) -> None:
        request_id = frame["id"]
        if request_id in self._orphans:
            if frame["finished"]:
                self._orphans.discard(request_id)
                if frame.get("prepared") is not None:  # captured as it was left: nobody will commit it
                    asyncio.ensure_future(self._abandon_quietly(request_id))
            return
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(frame)

    async def _abandon_quietly(self, request_id: str) -> None:
        try:
            await self.call("abandon", id=request_id)
        except EngineShutdownError:
            pass

    def _fail(self, why: str) -> None:
        if self._failure is not None:
            return
        self._failure = why
        for queue in self._streams.values():
            queue.put_nowait({"op": "failed", "error": why})
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineShutdownError(why))
        self._calls.clear()
        self._parts.clear()

    async def _send(self, message: dict[str, Any]) -> None:
        if self._failure is not None:
            raise EngineShutdownError(self._failure)
        try:
            self._process.stdin.write(wire.encode(message))
            await self._process.stdin.drain()
        except ConnectionError as e:  # the host is gone (its exit is being read)
            self._fail(f"the vLLM engine host is gone: {e!r}")
            raise EngineShutdownError(self._failure) from e

    # -- requests and calls ------------------------------------------------------------------------
    async def stream(self, request_id: str, prompt: list[int], params: dict[str, Any],
                     load: tuple[str, int] | None, capture: bool) -> AsyncIterator[dict[str, Any]]:
        """The request's frames until its last (`finished`); EngineShutdownError if the host dies."""
        await self.start()
        queue: asyncio.Queue = asyncio.Queue()
        self._giving_work()
        self._streams[request_id] = queue
        finished = False
        try:
            await self._send({"op": "add", "id": request_id, "prompt": prompt, "params": params,
                              "capture": capture, "load": {"head": load[0], "tokens": load[1]} if load else None})
            while not finished:
                frame = await queue.get()
                if frame["op"] == "failed":
                    raise EngineShutdownError(frame["error"])
                finished = frame["finished"]
                yield frame
        finally:
            del self._streams[request_id]
            if not finished:
                self._left(request_id, queue)

    def _left(self, request_id: str, queue: asyncio.Queue) -> None:
        """A stream left before its last frame: the request is aborted, and a turn captured as
        it finished (its last frame already here, or crossing the abort) is abandoned."""
        while not queue.empty():
            frame = queue.get_nowait()
            if frame.get("finished"):
                if frame.get("prepared") is not None:
                    asyncio.ensure_future(self._abandon_quietly(request_id))
                return
        if self._failure is None:
            self._orphans.add(request_id)
            asyncio.ensure_future(self._send_quietly({"op": "abort", "id": request_id}))

    async def _send_quietly(self, message: dict[str, Any]) -> None:
        try:
            await self._send(message)
        except EngineShutdownError:
            pass

    async def call(self, fn: str, **arguments: Any) -> Any:
        """A call on the host's store or engine, between two engine steps; ValueError if refused."""
        return (await self._call(fn, **arguments))["value"]

    async def export_head(self, head_id: str) -> tuple[int, list[bytes], bytes]:
        """(tokens the head covers, a part per block index, its Mamba state pages). The host
        builds them on a thread of its own and sends a frame per block: its engine goes on."""
        reply = await self._call("export", head=head_id)
        return reply["value"]["state_len"], reply["parts"], reply["value"]["state"]

    async def _call(self, fn: str, **arguments: Any) -> dict[str, Any]:
        await self.start()
        number = next(self._numbers)
        future = asyncio.get_running_loop().create_future()
        self._giving_work()
        self._calls[number] = future
        await self._send({"op": "call", "call": number, "fn": fn, **arguments})
        reply = await future
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply

    def check_alive(self) -> None:
        if self._failure is not None:
            raise EngineShutdownError(self._failure)

    def shutdown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._process is not None and self._process.returncode is None:
            self._process.kill()

    async def aclose(self) -> None:
        """Stop the host and wait for it to exit."""
        self.shutdown()
        if self._process is not None:
            await self._process.wait()
