"""The ingress's verdict on turns whose worker died around its publish, against the real cache
service and Redis. The replica is a stand-in that publishes exactly as a worker does (the real
client, the job's lease and publish id) and then dies where a real one can: no timing of a real
kill reaches these two instants reliably."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError, RaySystemError

from cache_service.client import LeaseLost, VersionConflict
from deployments.service.connection import cache_client_config
from deployments.turn.lease_keeper import LeaseKeeper
from deployments.messages import Recovery, TurnDelta, TurnDone, TurnFailed, TurnJob
from deployments.settings import AppSettings
from deployments.turn.request import TurnRequest
from deployments.turn.run import TurnRun
from proto.contract import ConversationRef, tokens_digest
from tests.cache_service.cs_helpers import fast_client

REPLY = "a reply nobody received"


class Replica:
    """One run of a turn: streams a delta, publishes, then dies where told to."""

    def __init__(self, cache, *, die_before_first_event: bool = False, die_after_publish: bool = False,
                 after_publish: BaseException | None = None, silent_after_publish: bool = False):
        self.cache, self.die_before, self.die_after = cache, die_before_first_event, die_after_publish
        self.after_publish, self.silent_after_publish = after_publish, silent_after_publish
        self.job: TurnJob | None = None
        self.cancelled = False

    async def publish(self) -> None:
        job, ids = self.job, [1, 2, 3]
        await self.cache.publish_turn(
            job.conversation, lease_token=job.lease,
            expected_version=job.head.version if job.head else 0,
            messages=[*job.messages, {"role": "assistant", "content": REPLY}], token_ids=ids,
            committed_tokens=len(ids), tokens_sha256=tokens_digest(ids), owner_replica="stand-in",
            release_lease=False, publish_id=job.publish_name)

    async def events(self):
        if self.die_before:
            raise ActorUnavailableError("the replica is gone", None)
        yield TurnDelta(REPLY[:7], (1,))
        await self.publish()
        if self.die_after:
            raise RayActorError()
        if self.after_publish is not None:
            raise self.after_publish
        if self.silent_after_publish:
            return  # the stream ends without the turn's outcome
        yield TurnDone("stop", 3, 3, 0, Recovery.NEW, "stand-in", turn=1, head_version=1)


class Stream:
    def __init__(self, replica: Replica):
        self.replica, self._events = replica, replica.events()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self._events)

    def cancel(self) -> None:
        self.replica.cancelled = True


class Workers:
    """What TurnRun calls: `options(stream=True).run_turn.remote(job)`, one replica per call."""

    def __init__(self, replicas: list[Replica]):
        self.replicas, self.calls = replicas, 0
        self.run_turn = self

    def options(self, **_):
        return self

    def remote(self, job: TurnJob) -> Stream:
        replica = self.replicas[self.calls]
        self.calls += 1
        replica.job = job
        return Stream(replica)


@pytest.fixture
async def service(bare_service):
    settings = AppSettings(cache_service=bare_service.target, lease_ttl_s=10, busy_wait_s=5)
    cache = fast_client(bare_service.target)
    keeper = LeaseKeeper(bare_service.target, cache_client_config("test", settings))
    yield settings, cache, keeper
    keeper.close()
    await cache.close()


async def run_turn(settings, cache, keeper, workers, conv_id) -> list:
    run = await TurnRun.start(settings, workers, cache, keeper, TurnRequest(
        [{"role": "user", "content": "hi"}], {}, "o", ConversationRef(conv_id, "o")))
    try:
        return [event async for event in run.events()]
    finally:
        await run.close()


async def test_a_turn_published_by_a_replica_that_died_before_answering_is_answered_from_the_ledger(
        service, conv_id):
    settings, cache, keeper = service
    events = await run_turn(settings, cache, keeper, Workers([Replica(cache, die_after_publish=True)]), conv_id)
    assert not any(isinstance(e, TurnFailed) for e in events), events
    done = events[-1]
    assert isinstance(done, TurnDone) and done.turn == 1 and done.recovery is Recovery.REPLAY
    assert "".join(e.text for e in events if isinstance(e, TurnDelta)) == REPLY  # the rest of the reply
    ledger = await cache.read_ledger(ConversationRef(conv_id, "o"))
    assert len(ledger.turns) == 1


async def test_a_retry_after_a_lost_replica_runs_under_a_new_lease_and_fences_the_old_run(service, conv_id):
    settings, cache, keeper = service
    lost, healthy = Replica(cache, die_before_first_event=True), Replica(cache)
    events = await run_turn(settings, cache, keeper, Workers([lost, healthy]), conv_id)
    assert isinstance(events[-1], TurnDone) and events[-1].turn == 1
    assert lost.job.lease.token != healthy.job.lease.token  # at most one run per lease
    with pytest.raises((LeaseLost, VersionConflict)):  # the lost run, had it lived on, cannot publish
        await lost.publish()
    ledger = await cache.read_ledger(ConversationRef(conv_id, "o"))
    assert len(ledger.turns) == 1


@pytest.mark.parametrize("replica", [
    {"silent_after_publish": True},  # its stream ended without TurnDone: was a bare 500
    {"after_publish": RaySystemError("the object store went away")},  # not an actor's death: was a raw error
    {"after_publish": ObjectLostError("00" * 28, "owner", "call site")},
], ids=["stream-ended", "ray-system-error", "object-lost"])
async def test_a_worker_that_ends_without_the_outcome_is_answered_from_the_ledger(service, conv_id, replica):
    settings, cache, keeper = service
    events = await run_turn(settings, cache, keeper, Workers([Replica(cache, **replica)]), conv_id)
    assert not any(isinstance(e, TurnFailed) for e in events), events
    assert isinstance(events[-1], TurnDone) and events[-1].recovery is Recovery.REPLAY, events[-1]
    assert "".join(e.text for e in events if isinstance(e, TurnDelta)) == REPLY


class StatelessReplica(Replica):
    """A stateless request's run: nothing to publish."""

    async def events(self):
        if self.die_before:
            raise ActorUnavailableError("the replica is gone", None)
        yield TurnDelta(REPLY, (1,))
        yield TurnDone("stop", 3, 1, 0, Recovery.NEW, "stand-in")


async def test_a_stateless_retry_after_a_lost_replica_runs_under_a_fresh_request_id(service):
    settings, cache, keeper = service
    lost, healthy = StatelessReplica(cache, die_before_first_event=True), StatelessReplica(cache)
    run = await TurnRun.start(settings, Workers([lost, healthy]), cache, keeper,
                              TurnRequest([{"role": "user", "content": "hi"}], {}, "o", None))
    try:
        events = [event async for event in run.events()]
    finally:
        await run.close()
    assert isinstance(events[-1], TurnDone), events
    # a revived replica would refuse the id it already ran (RequestIdInUse: a 400 for the client)
    assert healthy.job.request_id != lost.job.request_id
