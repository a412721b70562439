"""The worker's two paths to the state tier (EngineSession in-process against the session's real
cache service): the recovery ladder treats the tier as a cache (whatever error its read ends in,
the head is rebuilt from the ledger), and an export lands only under the conversation's life it
was committed in."""

from __future__ import annotations

import pytest

from cache_service.client import (
    CacheClient,
    DataLoss,
    DeadlineExceeded,
    ResourceExhausted,
    Unavailable,
)
from deployments.worker import recovery_ladder
from deployments.worker.engine_session import EngineSession
from deployments.messages import HeadRef, Recovery, TurnJob
from deployments.settings import AppSettings
from deployments.worker.tier_export import TierExporter
from proto.contract import ConversationRef
from tests.cache_service.cs_helpers import fast_client
from workers.sampling import SamplingParams

SALT = "ladder"


class TierFailing(CacheClient):
    """The real client, except that reading the tier ends in `error` (what a slow, overloaded
    or restarting service answers; no timing of a real fault reaches this one call)."""

    error: Exception

    async def get_state(self, conv, version=0, *, incarnation=None):
        raise self.error


@pytest.fixture(scope="module")
def settings(stack):
    return AppSettings(model=stack.model_dir, cache_service=stack.service.target, kv_cache_mb=8, head_cache_mb=8,
                       tier_export="async")


async def commit_turn(cache: CacheClient, session: EngineSession, conv: ConversationRef, text: str):
    """One first turn as a worker runs it: lease, turn, publish, commit here. The service's head."""
    lease = await cache.acquire_lease(conv, ttl_ms=10_000)
    final = None
    async for out in session.stream_turn(conv, [{"role": "user", "content": text}],
                                         SamplingParams(max_tokens=4, temperature=0.0), f"r-{text}"):
        final = out
    turn = final.turn_commit
    head = await cache.publish_turn(
        conv, lease_token=lease, expected_version=0, messages=turn.messages, token_ids=turn.token_ids,
        committed_tokens=turn.committed_tokens, tokens_sha256=turn.tokens_digest, owner_replica="r",
        publish_id=f"p-{text}")
    await session.commit(turn)
    return head


@pytest.fixture
async def exported_head(stack, settings, conv_id):
    """A conversation with one committed turn whose state the tier holds: (conversation id, head)."""
    cache, session = fast_client(stack.service.target), EngineSession(stack.model_dir, settings)
    try:
        conv = ConversationRef(conv_id, SALT)
        head = await commit_turn(cache, session, conv, "hello")
        _version, parts = await session.export_state(conv)
        await cache.put_state(conv, head, parts)
        yield conv_id, HeadRef.of(await cache.get_head(conv))
    finally:
        session.shutdown()
        await cache.close()


@pytest.mark.parametrize("error", [DeadlineExceeded("slow"), Unavailable("restarting"),
                                   ResourceExhausted("busy"), DataLoss("a chunk is gone")],
                         ids=lambda e: type(e).__name__)
async def test_a_failing_tier_read_falls_back_to_the_ledger(stack, settings, exported_head, error):
    conv_id, head = exported_head
    assert head.tier_version == head.version == 1  # the tier holds the head: the ladder reads it
    client = TierFailing(stack.service.target)
    client.error = error
    session = EngineSession(stack.model_dir, settings)
    try:
        async def cache() -> CacheClient:
            return client

        job = TurnJob("r2", [{"role": "user", "content": "again"}], {}, ConversationRef(conv_id, SALT), None, head)
        assert await recovery_ladder.attach(session, settings, cache, job) is Recovery.LEDGER_RECOMPUTE
    finally:
        session.shutdown()
        await client.close()


async def test_an_export_never_lands_under_a_re_created_conversation(stack, settings, conv_id):
    """The export of a head committed before the conversation was deleted and re-created (same
    id, salt and version) used to look the incarnation up at export time, find the new one, and
    store the old state as the new conversation's."""
    cache, session = fast_client(stack.service.target), EngineSession(stack.model_dir, settings)
    try:
        conv = ConversationRef(conv_id, SALT)
        old = HeadRef.of(await commit_turn(cache, session, conv, "before"))
        assert await cache.delete_conversation(conv)
        other = EngineSession(stack.model_dir, settings)  # the re-created conversation's owner
        try:
            new = await commit_turn(cache, other, conv, "after")
        finally:
            other.shutdown()
        assert (new.version, new.incarnation) == (old.version, new.incarnation) and new.incarnation != old.incarnation

        async def client() -> CacheClient:
            return cache

        exporter = TierExporter(session, settings, client, spawn=lambda coro: coro.close())
        await exporter.export_head(conv, old)  # the old owner's late write-behind export
        assert (await cache.get_head(conv)).tier_version == 0  # refused: the tier holds nothing of it
    finally:
        session.shutdown()
        await cache.close()
