"""A client leaving exactly as its turn finishes leaves nothing prepared on the replica (our
engine, EngineSession in-process, no Ray). Left prepared, the turn held its conversation busy
until it expired (60 s): every next turn to the owner was a 409.

    the engine finishes the turn ── its final output is queued ── the stream is left ──> abort
        (the abort finds nothing to abort: the prepared turn had no owner)
    the replica reads the final output ── yields its last delta ── the client leaves ──X _commit
        (the record was in hand but never published nor abandoned)
"""

from __future__ import annotations

import pytest

from deployments.messages import Recovery, TurnDelta, TurnJob
from deployments.routing.prefix_hints import Announcer
from deployments.settings import AppSettings
from deployments.worker.engine_session import EngineSession
from deployments.worker.replica import Worker
from proto.contract import ConversationRef
from tests.serve.test_replica_copies import committed_turn, model_dir, on_engine  # noqa: F401 (a fixture)
from workers.sampling import SamplingParams

CONV = ConversationRef("orphan", "s")
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)  # 6 tokens, the last in the final output


@pytest.fixture
def session(model_dir):  # noqa: F811
    s = EngineSession(str(model_dir), AppSettings(kv_cache_mb=8, head_cache_mb=8))
    yield s
    s.shutdown()


async def prepared(session: EngineSession, rid: str):
    return await on_engine(session, lambda cc: cc.prepared(rid))


async def until_prepared(session: EngineSession, rid: str) -> None:
    """Until the engine has finished the turn (each call waits for a pause between two steps)."""
    for _ in range(1000):
        if await prepared(session, rid) is not None:
            return
    raise AssertionError("the turn never finished")


async def test_a_stream_left_as_its_turn_finishes_abandons_the_prepared_turn(session):
    stream = session.stream_turn(CONV, [{"role": "user", "content": "hi"}], PARAMS, "t1")
    first = await anext(stream)
    assert not first.finished
    await until_prepared(session, "t1")  # the rest of its outputs, the final one too, unread
    await stream.aclose()  # the client leaves: the abort finds the request done
    assert await prepared(session, "t1") is None
    await committed_turn(session, CONV.id, "again", "t2")  # not busy: no 409 for a minute


def bare_worker(session: EngineSession):
    """The Worker deployment's class around an in-process session: only what `_run` uses."""
    worker = object.__new__(Worker.func_or_class)
    worker.session, worker.replica_id, worker._tasks = session, "replica-test", set()
    worker.announcer = Announcer(worker.replica_id, worker._cache, worker._spawn)  # withdraws evictions
    return worker


async def test_a_client_gone_at_the_last_delta_before_the_publish_abandons_the_prepared_turn(session):
    worker = bare_worker(session)
    job = TurnJob("t1", [{"role": "user", "content": "hi"}], {}, CONV)
    events = worker._run(job, PARAMS, session.stream_turn(CONV, job.messages, PARAMS, "t1"), Recovery.NEW)
    tokens = 0
    while tokens < PARAMS.max_tokens:  # until the final output is read and its delta yielded
        delta = await anext(events)
        assert isinstance(delta, TurnDelta)
        tokens += len(delta.token_ids)
    assert await prepared(session, "t1") is not None
    await events.aclose()  # the client leaves there, before `_commit`
    for task in list(worker._tasks):
        await task
    assert await prepared(session, "t1") is None
    await committed_turn(session, CONV.id, "again", "t2")
