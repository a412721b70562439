"""A replica's routing stats (`Worker.record_routing_stats`, read by the router through Serve)
answer at once, whatever its engine is doing (our engine, EngineSession in-process, no Ray)."""

from __future__ import annotations

import asyncio
import threading
import time

from tests.serve.test_replica_copies import committed_turn, model_dir, session  # noqa: F401 (fixtures)

BOUND = 30.0


async def test_the_load_is_read_while_the_engine_thread_is_busy(session):  # noqa: F811
    """Serve asks each replica for its stats every second and gives up after 5 s. The answer used
    to wait for the engine thread between two steps, and a long prefill step (a 14k-token history
    on two cores) held it past that: bench.agent's log was full of "Didn't receive routing stats",
    and the router priced a report 10 s old. Here a command holds the engine thread; the load is
    still read, as of the engine's last pause, and says when that was."""
    await committed_turn(session, "warm", "hello", "t1")
    gate = threading.Event()
    held = asyncio.ensure_future(session.aengine.call(lambda e: gate.wait(BOUND)))
    try:
        before = time.time()
        load = await asyncio.wait_for(session.load(), 2.0)
        usage = await asyncio.wait_for(session.kv_cache_usage(), 2.0)  # the stats' other engine figure
    finally:
        gate.set()
        await held
    assert 0 < load.taken_at <= before
    assert load.requests == 0 and usage == 0.0  # the turn ran to its end before: nothing holds blocks

