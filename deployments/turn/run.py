"""One chat completion as the ingress runs it: lease, route, stream, release.

    conversation turn:  acquire lease (409 / wait) -> read head -> TurnJob(head, lease token)
                        -> an Idempotency-Key already committed: answered from the ledger
                        -> Worker.run_turn via the sticky router, lease renewed meanwhile
                        -> TurnDone: the worker published; release the lease
                        -> a definite failure (bad input, conflict, client gone before the
                           publish): discard the lease, the head stays as it was
                        -> anything that may have published (replica lost, outcome unknown,
                           lease lost mid-turn): fence (discard the lease), then the ledger
                           says whether the turn committed, and the client is told that
    stateless request:  TurnJob with the full history, no lease

A stateless request and a conversation's first turn carry the replicas the prefix index names
as holding the longest prefix of their messages (routing/prefix_hints.py; a failed or slow lookup: none,
the router then goes by load), and those this ingress saw leave one in an answer it forwarded
(TurnDone.prefixes, recorded before the answer's end reaches the client: routing/recent_prefixes.py).

A replica lost before it produced anything is retried on another, under a new lease (at most
one run per lease: the old one is fenced first, and a turn it committed is answered from the
ledger); once tokens have gone out, the client gets the ledger's verdict instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from cache_service.client import CacheClient, CacheError, LeaseHeld, LeaseLost
from deployments import errors
from deployments.turn import outcome
from deployments.errors import APIError
from deployments.turn.lease_keeper import RENEWALS_PER_TTL, KeptLease, LeaseKeeper
from deployments.routing.prefix_hints import find_holders, tier_import_applies
from deployments.routing.token_estimate import prefix_estimates
from deployments.routing.recent_prefixes import RECENT
from deployments.messages import (ErrorKind, HeadRef, TurnDelta, TurnDone, TurnEvent, TurnFailed, TurnJob,
                                   prompt_as_messages)
from deployments.settings import AppSettings
from deployments.turn.outcome import IdempotencyKey
from deployments.turn.request import HeadMoved, TurnRequest
from proto.contract import ConversationRef, tools_scope

log = logging.getLogger("hybridserve.ingress")
RETRIES_BEFORE_FIRST_EVENT = 2
# How long the ingress keeps asking the cache service whether a turn committed before it tells
# the client the outcome is unknown (a retry with the same Idempotency-Key then learns it).
RECONCILE_BUDGET_S = 30.0

# Failures decided before anything could publish: the ledger cannot hold the turn.
_BEFORE_PUBLISH = (ErrorKind.INVALID, ErrorKind.TOO_LONG)


@dataclass
class Lease:
    conv: ConversationRef
    granted: Any  # the client's Lease: fenced calls get it back as it came


class _LeaseLostMidTurn(Exception):
    pass


class TurnRun:
    """Drives one request's events; `close()` must run whatever happened (it settles the lease)."""

    def __init__(self, settings: AppSettings, workers: DeploymentHandle, cache: CacheClient, job: TurnJob,
                 lease: Lease | None, keeper: LeaseKeeper | None = None):
        self.settings, self.workers, self.cache, self.job, self.lease = settings, workers, cache, job, lease
        self.keeper = keeper
        self.done: TurnDone | None = None
        self.replayed: list[TurnEvent] | None = None  # an idempotent retry of a committed turn
        self._renewer: KeptLease | None = None
        self._response = None
        self._fenced = False  # the lease was discarded to learn the turn's outcome: nothing to settle
        self._base_turn = job.head.turn if job.head is not None else 0  # the turn can only land after it
        self._base_version = job.head.version if job.head is not None else 0
        self.drop_if_uncommitted = False  # TurnRequest.drop_if_uncommitted
        self._lease_lost: asyncio.Future = asyncio.get_running_loop().create_future()

    @classmethod
    async def start(cls, settings: AppSettings, workers: DeploymentHandle, cache: CacheClient,
                    keeper: LeaseKeeper | None, request: TurnRequest) -> "TurnRun | HeadMoved":
        """The request's turn, ready to run (its lease held and kept), or HeadMoved (nothing
        held) when its conversation's head is not at `request.expect_turn`."""
        request_id = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        messages, tools, conversation = request.messages, request.tools, request.conversation
        if conversation is None:  # nothing is committed: a retry is harmless, no key needed
            named = messages if request.prompt is None else prompt_as_messages(request.prompt)
            scope = tools_scope(request.scope, tools)
            hints = await find_holders(cache, scope, named)
            tier = hints.tier if tier_import_applies(settings, request.prompt, request.sampling) else None
            job = TurnJob(request_id, messages, request.sampling, prefix_holders=hints.holders, tier_prefix=tier,
                          prefix_names=prefix_estimates(scope, named, tools, hints.longest),
                          stateless_scope=request.scope, tools=tools, parse_tool_calls=request.parse_tool_calls,
                          template=request.template, prompt=request.prompt)
            return cls(settings, workers, cache, job, None)
        granted = await _acquire(settings, cache, conversation, request_id, request.wait_if_busy)
        head = granted.head  # the head at the time of the acquire; version 0: a new conversation
        idempotency = request.idempotency
        job = TurnJob(request_id, messages, request.sampling, conversation, granted,
                      HeadRef.of(head) if head.version else None,
                      publish_id=idempotency.publish_id if idempotency else "", tools=tools,
                      parse_tool_calls=request.parse_tool_calls, template=request.template)
        run = cls(settings, workers, cache, job, Lease(conversation, granted), keeper)
        run.drop_if_uncommitted = request.drop_if_uncommitted
        try:
            # A retry first: its turn committed is answered wherever the head has moved since.
            if idempotency is not None and head.version:
                await run._find_earlier_run(idempotency, head.turn)
                if run.replayed is not None:
                    return run
            moved = await run._planned_head(request, head.version)
        except BaseException:
            await run.close()
            raise
        if moved is not None:
            await run.close()  # discards the lease: nothing ran
            return moved
        run._keep_lease()  # first: the lookup below must not eat into the lease
        if not head.version:  # a new conversation: where is its prefix held (a hint)?
            try:
                scope = tools_scope(conversation.salt, tools)
                hints = await find_holders(cache, scope, messages)
                run.job = replace(job, prefix_holders=hints.holders,
                                  prefix_names=prefix_estimates(scope, messages, tools, hints.longest))
            except BaseException:
                await run.close()  # cancelled meanwhile: the lease is settled, as after any failure
                raise
        return run

    @property
    def base_turn(self) -> int:
        """The head turn the turn follows (an answered retry's: the one its first run followed)."""
        return self._base_turn

    async def _planned_head(self, request: TurnRequest, head_version: int) -> HeadMoved | None:
        """Under the lease: None if the head is where the request was planned (expect_turn, and
        there the turn expect_publish_id names), else HeadMoved."""
        if request.expect_turn is None:
            return None
        if self._base_turn != request.expect_turn:
            return HeadMoved(self._base_turn)
        if not request.expect_publish_id or not head_version:
            return None
        try:
            ledger = await self.cache.read_ledger(self.lease.conv, from_turn=request.expect_turn, max_turns=1)
        except CacheError as e:
            raise errors.cache_failed(e) from e
        if ledger.turns and ledger.turns[0].publish_id == request.expect_publish_id:
            return None
        return HeadMoved(self._base_turn, replaced=True)

    async def _find_earlier_run(self, idempotency: IdempotencyKey, head_turn: int) -> None:
        """A turn with this key among the latest ones: the same body is answered from the
        ledger, another body is refused (the key names one request)."""
        after = max(0, head_turn - outcome.IDEMPOTENCY_WINDOW_TURNS)
        try:
            earlier = await outcome.find_turn(self.cache, self.lease.conv, after_turn=after,
                                                   match=idempotency.same_key)
        except CacheError as e:
            raise errors.cache_failed(e) from e
        if earlier is None:
            return
        if earlier.publish_id != idempotency.publish_id:
            raise APIError(422, "this Idempotency-Key was used with a different request", "idempotency_key_reused")
        self.replayed = outcome.replay(earlier)
        self._base_turn = earlier.turn - 1

    def _keep_lease(self) -> None:
        loop, lease = asyncio.get_running_loop(), self.lease

        def lost(error: LeaseLost) -> None:  # on the keeper's thread
            loop.call_soon_threadsafe(self._on_lease_lost, lease, error)

        self._renewer = self.keeper.keep(lease.conv, lease.granted, int(self.settings.lease_ttl_s * 1000), lost)

    def _on_lease_lost(self, lease: Lease, error: LeaseLost) -> None:
        if lease is self.lease and not self._lease_lost.done() and not self._fenced:
            log.warning("lease of %s lost mid-turn (%s): stopping the turn", self.job.conversation.id, error)
            self._lease_lost.set_result(error)

    async def events(self) -> AsyncIterator[TurnEvent]:
        """The worker's events, or the ledger's verdict where the worker's is unknown."""
        if self.replayed is not None:
            for event in self.replayed:
                self.done = event if isinstance(event, TurnDone) else self.done
                yield event
            return
        streamed = outcome.Streamed()
        for attempt in range(RETRIES_BEFORE_FIRST_EVENT + 1):
            self._response = self.workers.options(stream=True).run_turn.remote(self.job)
            told = False  # the worker's stream gave the turn's outcome (done or failed)
            try:
                while True:
                    event = await self._next_event()
                    if isinstance(event, TurnFailed) and self.lease is not None and event.kind not in _BEFORE_PUBLISH:
                        async for verdict in self._ledger_verdict(streamed, event):
                            yield verdict
                        return
                    if isinstance(event, TurnDone):
                        self.done = event
                        RECENT.record(event.replica, event.prefixes)  # before the client sees the end
                    elif isinstance(event, TurnDelta):
                        streamed.add(event)
                    told = told or isinstance(event, (TurnDone, TurnFailed))
                    yield event
            except StopAsyncIteration:
                if not told:  # it may have published before its stream ended: the ledger says
                    async for verdict in self._worker_failed(streamed, TurnFailed(
                            ErrorKind.INTERNAL, "the worker's stream ended without the turn's outcome")):
                        yield verdict
                return
            except BackPressureError as e:
                raise errors.overloaded(f"every worker is at capacity: {e}") from e
            except _LeaseLostMidTurn:
                self._response.cancel()
                async for verdict in self._ledger_verdict(streamed, TurnFailed(
                        ErrorKind.CONFLICT, "the conversation's lease was lost mid-turn; the turn was not committed")):
                    yield verdict
                return
            except RayTaskError as e:  # a bug in the worker: never retried, never a bad request
                log.error("worker failed: %s", e)
                async for verdict in self._worker_failed(streamed, TurnFailed(ErrorKind.INTERNAL, "the worker failed")):
                    yield verdict
                return
            except (RayActorError, ActorUnavailableError) as e:
                lost = TurnFailed(ErrorKind.UNAVAILABLE, f"the worker replica was lost: {type(e).__name__}")
                last = streamed.deltas > 0 or attempt == RETRIES_BEFORE_FIRST_EVENT
                if self.lease is None:
                    if last:
                        yield lost
                        return
                    # A fresh id: the lost replica, revived (or its engine still holding the first
                    # run), would refuse the same id (RequestIdInUse, a 400 for the client).
                    self.job = replace(self.job, request_id=f"{self.job.request_id}-retry{attempt + 1}")
                elif last or not await self._fence_and_lease_again():
                    # the lost replica may have published before it died: the ledger decides
                    async for verdict in self._ledger_verdict(streamed, lost):
                        yield verdict
                    return
                log.warning("worker lost before the turn started, retrying: %s", e)
            except RayError as e:  # any other Ray failure (object lost, cancelled, system): as a worker's bug
                log.error("worker call failed: %s: %s", type(e).__name__, e)
                async for verdict in self._worker_failed(streamed, TurnFailed(
                        ErrorKind.INTERNAL, f"the worker call failed: {type(e).__name__}")):
                    yield verdict
                return

    async def _worker_failed(self, streamed: outcome.Streamed, failed: TurnFailed) -> AsyncIterator[TurnEvent]:
        """The worker failed without telling the turn's outcome: a stateless turn fails, a
        conversation's turn gets the ledger's verdict (it may have been published)."""
        if self.lease is None:
            yield failed
            return
        async for verdict in self._ledger_verdict(streamed, failed):
            yield verdict

    async def _next_event(self) -> TurnEvent:
        """The worker's next event, unless the lease is lost first (then the turn is doomed)."""
        step = asyncio.ensure_future(anext(self._response))
        try:
            await asyncio.wait({step, self._lease_lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not step.done():
                step.cancel()
        if step.done():
            return step.result()
        raise _LeaseLostMidTurn()

    async def _ledger_verdict(self, streamed: outcome.Streamed, failure: TurnFailed) -> AsyncIterator[TurnEvent]:
        """After a failure that may have followed the publish: what the ledger holds."""
        try:
            committed = await self._committed_turn()
        except CacheError as e:
            log.warning("outcome of %s unknown: %s", self.job.publish_name, e)
            yield TurnFailed(ErrorKind.OUTCOME_UNKNOWN,
                             "the turn may or may not have been committed (the cache service did not answer); "
                             "retry with the same Idempotency-Key to learn which")
            return
        if committed is None:
            yield failure
            return
        log.info("turn %s committed though its worker did not say so: answered from the ledger",
                 self.job.publish_name)
        for event in outcome.replay(committed, streamed):
            self.done = event if isinstance(event, TurnDone) else self.done
            yield event

    async def _committed_turn(self):
        """Fence the lease, then find this turn's publish in the ledger (None: not committed)."""
        deadline = time.monotonic() + RECONCILE_BUDGET_S
        while True:
            try:
                await self._fence()
                return await self._find_own_turn()
            except CacheError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def _find_own_turn(self):
        return await outcome.find_turn(self.cache, self.lease.conv, after_turn=self._base_turn,
                                            match=lambda pid: pid == self.job.publish_name)

    async def _fence(self) -> None:
        if self._fenced:
            return
        if self._renewer is not None:
            self._renewer.stop()
        try:
            await self.cache.discard(self.lease.conv, self.lease.granted)
        except LeaseLost:
            pass  # expired or taken over: nothing can publish under it either
        self._fenced = True

    async def _fence_and_lease_again(self) -> bool:
        """Before a retry on another replica: fence the lost run's lease, and if its turn did
        not commit, run the turn again under a new lease (False: it committed, or the outcome
        or the lease could not be had)."""
        try:
            if await self._committed_turn() is not None:
                return False
            granted = await _acquire(self.settings, self.cache, self.lease.conv, self.job.request_id, True)
        except (CacheError, APIError) as e:
            log.warning("cannot retry %s: %s", self.job.publish_name, e)
            return False
        head = granted.head
        self.lease, self._fenced = Lease(self.lease.conv, granted), False
        self.job = replace(self.job, lease=granted, head=HeadRef.of(head) if head.version else None)
        self._keep_lease()
        # While the lease was free, a duplicate of this request (same Idempotency-Key and body,
        # so the same publish name) may have taken it and committed the turn: then it is not run
        # again (False: the ledger's verdict answers it).
        try:
            return await self._find_own_turn() is None
        except CacheError:
            return False

    async def close(self) -> None:
        if self._response is not None and self.done is None:
            self._response.cancel()  # the client left or the turn failed: the worker aborts
        if self._renewer is not None:
            self._renewer.stop()
            if self._renewer.worst_delay_s > self.settings.lease_ttl_s / RENEWALS_PER_TTL:
                log.warning("lease renewals of %s ran up to %.2f s late", self.job.conversation.id,
                            self._renewer.worst_delay_s)
        if self.lease is not None and not self._fenced:
            await asyncio.shield(_settle(self.cache, self.lease, committed=self.done is not None))
        if self.drop_if_uncommitted and self.lease is not None and self.done is None and self.replayed is None:
            await asyncio.shield(drop_unpublished(self.cache, self.lease.conv, self._base_version))


async def _acquire(settings: AppSettings, cache: CacheClient, conv: ConversationRef, request_id: str,
                   wait_if_busy: bool):
    try:
        return await cache.acquire_lease(conv, int(settings.lease_ttl_s * 1000), holder=f"ingress:{request_id}",
                                         wait_s=settings.busy_wait_s if wait_if_busy else 0.0)
    except LeaseHeld:
        raise errors.busy(conv.id) from None
    except CacheError as e:
        raise errors.cache_failed(e) from e


async def drop_unpublished(cache: CacheClient, conv: ConversationRef, version: int) -> None:
    """Delete a fork whose first turn did not commit, if its head is still the copy's (`version`).
    Called once the turn's lease is settled: no run of that turn can publish after the check."""
    try:
        head = await cache.get_head_or_none(conv)
        if head is not None and head.version == version:
            await cache.delete_conversation(conv)
    except CacheError as e:  # left to the conversation TTL
        log.warning("could not drop the uncommitted fork %s: %s", conv.id, e)


async def _settle(cache: CacheClient, lease: Lease, *, committed: bool) -> None:
    try:
        if committed:
            await cache.release_lease(lease.conv, lease.granted)
        else:
            await cache.discard(lease.conv, lease.granted)
    except CacheError as e:  # the lease expires by itself; nothing committed depends on this
        log.warning("could not settle the lease of %s: %s", lease.conv.id, e)


def first_error(event: TurnEvent) -> APIError | None:
    return errors.from_kind(event.kind, event.message) if isinstance(event, TurnFailed) else None


__all__ = ["TurnRun", "TurnDelta", "TurnDone", "TurnFailed", "first_error"]
