"""The asyncio front: one stream per request id, cancellation aborts what it started, a
failing delivery touches only its caller, shutdown resolves every stream and call.

A hang is the failure mode of every defect here, so each wait is bounded (`BOUND` seconds):
a broken implementation fails on the bound instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.engine.conftest import new_engine, prompt_of
from workers.async_engine import AsyncEngine
from workers.checkpoint import Arch
from workers.errors import EngineShutdownError, InvalidRequestError, RequestIdInUseError
from workers.request import FinishReason
from workers.sampling import SamplingParams

BOUND = 60.0
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture
def aengine(tiny):
    engine = AsyncEngine(new_engine(tiny[Arch.BAMBA].path))
    yield engine
    engine.shutdown()


async def _collect(stream) -> list:
    return [out async for out in stream]


async def test_a_second_stream_of_a_streaming_id_is_refused_and_the_first_finishes(aengine):
    first = aengine.generate(prompt_of(9, seed=1), LONG, request_id="x")
    got_one = await asyncio.wait_for(first.__anext__(), BOUND)
    with pytest.raises(RequestIdInUseError):
        await asyncio.wait_for(_collect(aengine.generate(prompt_of(5, seed=2), LONG, request_id="x")), BOUND)
    rest = await asyncio.wait_for(_collect(first), BOUND)
    outputs = [got_one, *rest]
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_tokens) for o in outputs) == LONG.max_tokens
    assert issubclass(RequestIdInUseError, InvalidRequestError)


async def test_cancelling_the_caller_while_start_runs_aborts_the_request(aengine):
    entered, release = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()
    added = {}

    def start(engine):
        loop.call_soon_threadsafe(entered.set)
        assert release.wait(BOUND)
        added["request"] = engine.add_request("slow-start", prompt_of(9, seed=3), LONG)

    task = asyncio.create_task(_collect(aengine.stream("slow-start", start)))
    await asyncio.wait_for(entered.wait(), BOUND)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    # Commands run in order: whatever the cancelled caller queued runs before this one.
    request = await asyncio.wait_for(aengine.call(lambda e: added["request"]), BOUND)
    assert request.finish_reason is FinishReason.ABORT
    assert len(request.output) < LONG.max_tokens
    assert not await aengine.call(lambda e: e.has_unfinished())


def test_a_caller_whose_loop_closed_does_not_stop_the_engine(tiny):
    aengine = AsyncEngine(new_engine(tiny[Arch.BAMBA].path))
    try:
        orphan_loop = asyncio.new_event_loop()
        stream = aengine.generate(prompt_of(9, seed=4), LONG, request_id="orphan")
        orphan_loop.run_until_complete(stream.__anext__())
        orphan_loop.close()  # the caller vanished with its stream still registered

        async def others():
            outs = await asyncio.wait_for(_collect(aengine.generate(prompt_of(7, seed=5), LONG)), BOUND)
            idle = await asyncio.wait_for(aengine.call(lambda e: not e.has_unfinished()), BOUND)
            return outs, idle

        outs, idle = asyncio.run(others())
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert idle  # the orphan was aborted, not left running
    finally:
        aengine.shutdown()


def test_shutdown_fails_pending_streams_and_calls(tiny):
    aengine = AsyncEngine(new_engine(tiny[Arch.BAMBA].path, max_num_seqs=1))
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run():
        stream = aengine.generate(prompt_of(9, seed=6), params, request_id="busy")
        await asyncio.wait_for(stream.__anext__(), BOUND)
        rest = asyncio.create_task(_collect(stream))
        await asyncio.to_thread(aengine.shutdown)
        with pytest.raises(EngineShutdownError):
            await asyncio.wait_for(rest, BOUND)
        with pytest.raises(EngineShutdownError):
            await asyncio.wait_for(aengine.call(lambda e: None), BOUND)

    asyncio.run(run())
    assert not aengine.engine.has_unfinished()
    aengine.engine.check_integrity()


async def test_a_start_that_adds_nothing_gives_an_empty_stream(aengine):
    assert await asyncio.wait_for(_collect(aengine.stream("nothing", lambda e: None)), BOUND) == []
    outs = await asyncio.wait_for(_collect(aengine.generate(prompt_of(5, seed=7), LONG, request_id="nothing")), BOUND)
    assert outs[-1].finished
