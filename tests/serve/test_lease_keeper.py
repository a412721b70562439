"""A turn keeps its lease through slow and failing renewals, and loses it only when it is lost.

Real Redis, the real cache service, the ingress's TurnRun and LeaseKeeper. The keeper renews
through a real gRPC server in front of the service that forwards RenewLease as it came, after
a fault of the test's choosing (a delay, an UNKNOWN or INTERNAL answer); the turn's other calls
go straight to the service. The replica is a stand-in that streams for a few TTLs and then
publishes exactly as a worker does (no Ray: the keeper, not the engine, is under test).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest

from cache_service.client import LeaseLost, VersionConflict
from deployments.messages import ErrorKind, Recovery, TurnDelta, TurnDone, TurnFailed, TurnJob
from deployments.service.connection import cache_client_config
from deployments.settings import AppSettings
from deployments.turn.lease_keeper import LeaseKeeper, Renewal
from deployments.turn.request import TurnRequest
from deployments.turn.run import TurnRun
from proto.contract import ConversationRef, tokens_digest
from tests.cache_service.cs_helpers import fast_client

TTL_S = 2.0  # renewals every 0.5 s: a turn survives a second's stall of this process, as on a loaded machine
TURN_S = 3 * TTL_S  # the turn outlives its lease three times over unless it is renewed
Fault = Callable[[int, grpc.aio.ServicerContext], Awaitable[None]]


class RenewalFaults:
    """A gRPC server that forwards RenewLease to the service, after `fault(n, context)` (n: the
    renewal's number from 0), which may sleep or abort the call."""

    def __init__(self, target: str):
        self.fault: Fault | None = None
        self.calls = 0
        self._channel = grpc.aio.insecure_channel(target)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers([self])
        self.target = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"

    def service(self, details: grpc.HandlerCallDetails):
        if not details.method.endswith("/RenewLease"):
            return None
        forward = self._channel.unary_unary(details.method)  # bytes in, bytes out

        async def renew(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            n, self.calls = self.calls, self.calls + 1
            if self.fault is not None:
                await self.fault(n, context)
            try:
                return await forward(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:  # the service's own verdict, reason metadata and all
                await context.abort(e.code(), e.details() or "", tuple(e.trailing_metadata() or ()))

        return grpc.unary_unary_rpc_method_handler(renew)


@pytest.fixture
async def turns(bare_service):
    """(settings, cache client, faults, renewals seen by the keeper) for turns kept through `faults`."""
    service = bare_service
    faults = RenewalFaults(service.target)
    await faults._server.start()
    settings = AppSettings(cache_service=service.target, lease_ttl_s=TTL_S, busy_wait_s=5)
    cache = fast_client(service.target)
    renewals: list[tuple[float, Renewal]] = []
    keeper = LeaseKeeper(faults.target, cache_client_config("test", settings),
                         on_renewal=lambda s, r: renewals.append((s, r)))
    yield settings, cache, keeper, faults, renewals
    keeper.close()
    await cache.close()
    await faults._server.stop(None)
    await faults._channel.close()


class Replica:
    """Streams a delta every 50 ms for `TURN_S`, then publishes as a worker does."""

    def __init__(self, cache):
        self.cache, self.job, self.cancelled = cache, None, False

    async def events(self):
        job, ids = self.job, [1, 2, 3]
        end = time.monotonic() + TURN_S
        while time.monotonic() < end:
            await asyncio.sleep(0.05)  # a token's time: the stand-in's stream has no event to await
            yield TurnDelta("x", (1,))
        try:
            await self.cache.publish_turn(
                job.conversation, lease_token=job.lease, expected_version=0,
                messages=[*job.messages, {"role": "assistant", "content": "x"}], token_ids=ids,
                committed_tokens=len(ids), tokens_sha256=tokens_digest(ids), owner_replica="stand-in",
                release_lease=False, publish_id=job.publish_name)
        except (LeaseLost, VersionConflict) as e:  # what a real worker answers then
            yield TurnFailed(ErrorKind.CONFLICT, f"the turn was not committed: {e}")
            return
        yield TurnDone("stop", 3, 3, 0, Recovery.NEW, "stand-in", turn=1, head_version=1)


class Workers:
    """What TurnRun calls: `options(stream=True).run_turn.remote(job)`."""

    def __init__(self, replica: Replica):
        self.replica = replica
        self.run_turn = self

    def options(self, **_):
        return self

    def remote(self, job: TurnJob):
        self.replica.job = job
        self._events = self.replica.events()
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self._events)

    def cancel(self) -> None:
        self.replica.cancelled = True


async def run_turn(settings, cache, keeper, conv_id: str, during: Callable[[TurnRun], Awaitable[None]] | None = None):
    """The turn's events; `during(run)` runs beside the turn once it has started."""
    replica = Replica(cache)
    run = await TurnRun.start(settings, Workers(replica), cache, keeper, TurnRequest(
        [{"role": "user", "content": "hi"}], {}, "o", ConversationRef(conv_id, "o")))
    side = asyncio.create_task(during(run)) if during else None
    try:
        return [event async for event in run.events()], replica
    finally:
        await run.close()
        if side is not None:
            await side


def committed(events) -> bool:
    return isinstance(events[-1], TurnDone) and events[-1].turn == 1 and not any(
        isinstance(e, TurnFailed) for e in events)


async def test_slow_renewals_do_not_hold_back_the_next_ones(turns, conv_id):
    settings, cache, keeper, faults, renewals = turns

    async def every_other_one_slow(n, _context):  # far past the deadline: the keeper gives up on it
        if n % 2 == 0:
            await asyncio.sleep(2 * TTL_S)

    faults.fault = every_other_one_slow
    events, _ = await run_turn(settings, cache, keeper, conv_id)
    assert committed(events), events[-1]
    outcomes = [r for _, r in renewals]
    assert Renewal.FAILED in outcomes and Renewal.RENEWED in outcomes, outcomes
    # each slow one was cut when the lease would have lapsed, not waited for
    assert all(s < TTL_S + 0.5 for s, r in renewals if r is Renewal.FAILED), renewals


@pytest.mark.parametrize("code", [grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL])
async def test_failed_renewals_are_retried_at_the_next_tick(turns, conv_id, code):
    settings, cache, keeper, faults, renewals = turns

    async def every_other_one_fails(n, context):
        if n % 2 == 0:
            await context.abort(code, "the service's handler crashed")

    faults.fault = every_other_one_fails
    events, _ = await run_turn(settings, cache, keeper, conv_id)
    assert committed(events), events[-1]
    failed = [s for s, r in renewals if r is Renewal.FAILED]
    assert len(failed) >= 2, renewals  # recorded with their latency, like the successful ones


async def test_a_lease_the_service_says_is_gone_stops_the_turn_at_once(turns, conv_id):
    settings, cache, keeper, faults, renewals = turns
    released = asyncio.get_running_loop().create_future()

    async def take_it_away(run: TurnRun) -> None:
        await asyncio.sleep(TTL_S / 2)  # mid-turn
        await cache.release_lease(run.lease.conv, run.lease.granted)  # someone else's hands now
        released.set_result(time.monotonic())

    events, replica = await run_turn(settings, cache, keeper, conv_id, take_it_away)
    stopped = time.monotonic() - await released
    assert isinstance(events[-1], TurnFailed) and events[-1].kind is ErrorKind.CONFLICT, events[-1]
    assert replica.cancelled and stopped < TURN_S / 2, stopped  # at the next renewals, not at the end of the stream
    assert (Renewal.LOST in [r for _, r in renewals])


async def test_a_lease_never_renewed_for_a_whole_ttl_stops_the_turn(turns, conv_id):
    settings, cache, keeper, faults, renewals = turns

    async def all_fail(_n, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the service is unreachable")

    faults.fault = all_fail
    started = time.monotonic()
    events, replica = await run_turn(settings, cache, keeper, conv_id)
    assert isinstance(events[-1], TurnFailed) and events[-1].kind is ErrorKind.CONFLICT, events[-1]
    assert replica.cancelled and time.monotonic() - started < TURN_S, "the turn ran to its end"
