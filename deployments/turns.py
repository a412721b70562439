"""One chat completion as the ingress runs it: lease, route, stream, release.

    conversation turn:  acquire lease (409 / wait) -> read head -> TurnJob(head, lease token)
                        -> Worker.run_turn via the sticky router, lease renewed meanwhile
                        -> TurnDone: the worker published; release the lease
                        -> anything else (error, replica lost, client gone): discard the lease,
                           the head stays as it was
    stateless request:  TurnJob with the full history, no lease

A replica lost before it produced anything is retried on another (nothing was published,
nothing streamed); once tokens have gone out, the client gets the error instead.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from cache_service.client import CacheClient, CacheError, Conversation, LeaseHeld, LeaseLost
from deployments import errors
from deployments.errors import APIError
from deployments.protocol import ErrorKind, HeadRef, TurnDelta, TurnDone, TurnEvent, TurnFailed, TurnJob
from deployments.settings import AppSettings

log = logging.getLogger("hybridserve.ingress")
RETRIES_BEFORE_FIRST_EVENT = 2


@dataclass
class Lease:
    conv: Conversation
    granted: Any  # the client's Lease: fenced calls get it back as it came


class TurnRun:
    """Drives one request's events; `close()` must run whatever happened (it settles the lease)."""

    def __init__(self, settings: AppSettings, workers: DeploymentHandle, cache: CacheClient, job: TurnJob,
                 lease: Lease | None):
        self.settings, self.workers, self.cache, self.job, self.lease = settings, workers, cache, job, lease
        self.done: TurnDone | None = None
        self._renewer: asyncio.Task | None = None
        self._response = None

    @classmethod
    async def start(cls, settings: AppSettings, workers: DeploymentHandle, cache: CacheClient, *,
                    messages: list[dict], sampling: dict, conversation_id: str | None, cache_salt: str,
                    wait_if_busy: bool) -> "TurnRun":
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if conversation_id is None:
            return cls(settings, workers, cache, TurnJob(request_id, messages, sampling), None)
        conv = Conversation(conversation_id, cache_salt)
        ttl_ms = int(settings.lease_ttl_s * 1000)
        try:
            granted = await cache.acquire_lease(conv, ttl_ms, holder=f"ingress:{request_id}",
                                                wait_s=settings.busy_wait_s if wait_if_busy else 0.0)
        except LeaseHeld:
            raise errors.busy(conversation_id) from None
        except CacheError as e:
            raise errors.overloaded(f"cache service unavailable: {e}") from e
        lease = Lease(conv, granted)
        head = granted.head  # the head at the time of the acquire; version 0: a new conversation
        ref = HeadRef.of(head) if head.version else None
        job = TurnJob(request_id, messages, sampling, conversation_id, cache_salt, granted, ref)
        run = cls(settings, workers, cache, job, lease)
        run._renewer = asyncio.create_task(run._renew(ttl_ms))
        return run

    async def _renew(self, ttl_ms: int) -> None:
        while True:
            await asyncio.sleep(ttl_ms / 3000)
            try:
                await self.cache.renew_lease(self.lease.conv, self.lease.granted, ttl_ms)
            except LeaseLost:
                log.warning("lease of %s lost mid-turn; the worker's publish will be refused", self.job.conversation_id)
                return
            except CacheError as e:
                log.warning("lease renewal failed (retrying): %s", e)

    async def events(self) -> AsyncIterator[TurnEvent]:
        """The worker's events; replicas lost before the first event are retried."""
        for attempt in range(RETRIES_BEFORE_FIRST_EVENT + 1):
            started = False
            self._response = self.workers.options(stream=True).run_turn.remote(self.job)
            try:
                async for event in self._response:
                    started = True
                    if isinstance(event, TurnDone):
                        self.done = event
                    yield event
                return
            except BackPressureError as e:
                raise errors.overloaded(f"every worker is at capacity: {e}") from e
            except RayTaskError as e:  # a bug in the worker: never retried, never a bad request
                log.error("worker failed: %s", e)
                yield TurnFailed(ErrorKind.INTERNAL, f"the worker failed: {type(e.cause).__name__}: {e.cause}")
                return
            except (RayActorError, ActorUnavailableError) as e:
                if started or attempt == RETRIES_BEFORE_FIRST_EVENT:
                    yield TurnFailed(ErrorKind.UNAVAILABLE, f"the worker replica was lost: {type(e).__name__}")
                    return
                log.warning("worker lost before the turn started, retrying: %s", e)

    async def close(self) -> None:
        if self._response is not None and self.done is None:
            self._response.cancel()  # the client left or the turn failed: the worker aborts
        if self._renewer is not None:
            self._renewer.cancel()
        if self.lease is not None:
            await asyncio.shield(_settle(self.cache, self.lease, committed=self.done is not None))


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
