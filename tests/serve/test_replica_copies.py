"""A worker replica's copies of conversations are bounded (EngineSession in-process, no Ray):
after each turn's verdict a ledger with no head here and no turn on its way is dropped (the
service's ledger is the record), and a conversation idle here longer than the TTL is forgotten
whole, so a DELETE served by another replica leaves this copy for at most that long."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from deployments.worker.engine_session import EngineSession
from deployments.messages import HeadRef
from deployments.settings import AppSettings
from proto.contract import ConversationRef
from workers.checkpoint import Arch, Preset, make_model
from workers.sampling import SamplingParams

SALT = "s"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("copies") / "model", Arch.BAMBA, Preset.TINY, seed=4)


@pytest.fixture
def session(model_dir):
    s = EngineSession(str(model_dir), AppSettings(kv_cache_mb=8, head_cache_mb=8))
    yield s
    s.shutdown()


async def prepare(session: EngineSession, cid: str, text: str, rid: str):
    final = None
    async for out in session.stream_turn(ConversationRef(cid, SALT), [{"role": "user", "content": text}],
                                         SamplingParams(max_tokens=4, temperature=0.0), rid):
        final = out
    assert final.turn_commit is not None
    return final.turn_commit


async def committed_turn(session: EngineSession, cid: str, text: str, rid: str) -> None:
    session.turn_started(ConversationRef(cid, SALT))  # as Worker.run_turn does, around recovery, turn and verdict
    try:
        await session.commit(await prepare(session, cid, text, rid))
    finally:
        session.turn_ended(ConversationRef(cid, SALT))


async def on_engine(session: EngineSession, fn):
    return await session.aengine.call(lambda _e: fn(session.cache))


async def adopt_copy_of(session: EngineSession, source: str, cid: str) -> None:
    """What the recovery ladder does first: adopt the service's ledger (here: source's)."""
    d = await on_engine(session, lambda cc: cc.describe(ConversationRef(source, SALT)))
    head = HeadRef(d["version"], d["turn"], d["committed_tokens"], d["tokens_digest"], "", 0)
    await session.adopt_ledger(ConversationRef(cid, SALT), head, d["ledger"])


async def ledger(session: EngineSession, cid: str):
    return await on_engine(session, lambda cc: cc.ledger_state(ConversationRef(cid, SALT)))


async def test_a_verdict_drops_headless_ledgers_but_not_one_being_recovered(session):
    await committed_turn(session, "a", "first", "r1")
    await adopt_copy_of(session, "a", "headless")  # a turn here that failed before it began
    session.turn_started(ConversationRef("recovering", SALT))  # its ledger adopted, its turn not begun yet
    await adopt_copy_of(session, "a", "recovering")
    await committed_turn(session, "b", "second", "r2")
    assert await ledger(session, "headless") is None
    assert await ledger(session, "recovering") is not None, "a turn is about to continue it"
    assert await ledger(session, "a") is not None and await ledger(session, "b") is not None

    # An abandoned turn's verdict drops them too, and the recovered turn runs on its ledger.
    await adopt_copy_of(session, "a", "headless")
    await session.abandon(await prepare(session, "recovering", "third", "r3"))
    session.turn_ended(ConversationRef("recovering", SALT))
    assert await ledger(session, "headless") is None
    assert (await ledger(session, "recovering")).turn == 1  # kept for its turn, untouched by the abandon
    await committed_turn(session, "b", "fourth", "r4")  # the next verdict: now it goes (no head)
    assert await ledger(session, "recovering") is None
    assert await on_engine(session, lambda cc: cc.stats()["ledgers"]) == 2  # a and b, with their heads


async def test_idle_copies_are_forgotten_after_the_ttl(session):
    # A TTL of a second: the checks that something was used "just now" read it after a few engine
    # round trips, which a loaded machine can stretch past a fraction of one.
    idle_s = 1.0
    for cid in ("a", "b", "pending"):
        await committed_turn(session, cid, "first", f"{cid}1")
    session.turn_started(ConversationRef("pending", SALT))
    record = await prepare(session, "pending", "awaiting its verdict", "p2")
    session.turn_ended(ConversationRef("pending", SALT))  # the publish outlived the request (answered "unknown")
    assert await session.forget_idle(10.0) == 0  # nothing idle that long
    await asyncio.sleep(idle_s + 0.2)
    session.turn_started(ConversationRef("a", SALT))  # a turn of a arrives

    assert await session.forget_idle(idle_s) == 1
    assert await ledger(session, "b") is None and await session.held_heads(ConversationRef("b", SALT)) == 0
    assert await ledger(session, "a") is not None and await session.held_heads(ConversationRef("a", SALT)) == 1
    assert (await ledger(session, "pending")).busy, "a turn awaiting its verdict is never dropped"

    await session.commit(record)
    session.turn_ended(ConversationRef("a", SALT))
    assert await session.forget_idle(idle_s) == 0  # used just now: both count from their last use
    await asyncio.sleep(idle_s + 0.2)
    assert await session.forget_idle(idle_s) == 2
    assert await session.held_heads() == 0
    assert await on_engine(session, lambda cc: cc.stats()["ledgers"]) == 0


def test_the_ttl_is_a_positive_setting():
    assert AppSettings().replica_copy_ttl_s == 3600
    for bad in (0, -1):
        with pytest.raises(ValidationError):
            AppSettings(replica_copy_ttl_s=bad)
