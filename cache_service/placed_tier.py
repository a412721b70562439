"""The state tier over several instances: an entry is written to its `copies` best-ranked live
instances (placement.py) and read from the first of its ranked instances that holds it.

Why a copy on the second-ranked instance (ClientConfig.tier_copies, 2 by default): an instance
lost takes its entries with it, and every conversation whose only entry it held is then
recomputed from the ledger, a prefill of its whole history on the GPU (seconds for a long chat),
all at once, on the replicas that take those conversations over. With a copy that costs
nothing: the next-ranked instance holds it, and is exactly where the walk below looks next. The
price is paid off the turn path: an export travels twice, in parallel (its latency is the slower
of the two, not the sum), and the tier holds each entry twice (N instances hold N/2 instances'
worth of entries). Cheap for what it saves; `tier_copies=1` turns it off.

    put:  order = ranked(key) = [live in HRW order..., down ones...]
          put on order[:copies] at once; each one UNAVAILABLE is marked down and replaced by the
          next in order; done when `copies` took it (or the order ran out: one copy is enough)
    get:  walk the order; an instance that answers "not here" (or holds another incarnation) is a
          miss; stop at the first hit, or after copies + 1 misses (an instance that came back empty,
          then the copies): NotFound, never a hang. Only if no instance answered at all is the
          walk retried with backoff, as a single instance's calls are.

Errors other than UNAVAILABLE (VersionConflict, NotFound of the head, InvalidArgument) come from
Redis or the request, so every instance would give the same answer: the first is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from cache_service.client_config import RetryPolicy
from cache_service.errors import CacheError, DataLoss, NotFound, Unavailable
from cache_service.instances import InstancePool
from proto import cache_pb2 as pb

PutOn = Callable[[str], Awaitable[pb.PutStateResponse]]  # one put on one instance, one attempt
GetOn = Callable[[str], Awaitable[tuple[pb.StateManifest, bytes]]]  # one read of one instance


async def put(pool: InstancePool, key: str, copies: int, put_on: PutOn, retry: RetryPolicy) -> pb.PutStateResponse:
    for attempt in range(retry.attempts):
        done, failures = await _put_walk(pool, await pool.ranked(key), copies, put_on)
        if done:
            return done[0]
        hard = [e for e in failures if not isinstance(e, Unavailable)]
        if hard or attempt == retry.attempts - 1:
            raise (hard or failures)[0]
        await asyncio.sleep(retry.backoff(attempt))
    raise AssertionError("unreachable")


async def _put_walk(pool: InstancePool, order: list[str], copies: int,
                    put_on: PutOn) -> tuple[list[pb.PutStateResponse], list[CacheError]]:
    done: list[pb.PutStateResponse] = []
    failures: list[CacheError] = []
    while order and len(done) < copies:
        batch, order = order[:copies - len(done)], order[copies - len(done):]
        outcomes = await asyncio.gather(*(put_on(a) for a in batch), return_exceptions=True)
        for address, outcome in zip(batch, outcomes):
            if isinstance(outcome, Unavailable):
                pool.mark_down(address)
                failures.append(outcome)
            elif isinstance(outcome, CacheError):
                failures.append(outcome)
                order = []  # Redis's or the request's answer: the same on every instance
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                done.append(outcome)
    return done, failures


async def get(pool: InstancePool, key: str, copies: int, get_on: GetOn, retry: RetryPolicy, *,
              incarnation: str | None) -> tuple[int, bytes]:
    for attempt in range(retry.attempts):
        misses = 0
        for address in await pool.ranked(key):
            try:
                manifest, data = await get_on(address)
            except (NotFound, DataLoss):  # DataLoss: that instance dropped its copy; another may be whole
                misses += 1
            except Unavailable:
                pool.mark_down(address)
                continue
            else:
                if incarnation is None or manifest.incarnation == incarnation:
                    return manifest.version, data
                misses += 1  # a copy left from before the conversation was deleted and re-created
            if misses > copies:
                break
        if misses:
            raise NotFound("no cache-service instance holds this state (its instances were lost, "
                           "or it was never exported): recover from the ledger")
        if attempt < retry.attempts - 1:
            await asyncio.sleep(retry.backoff(attempt))
    raise Unavailable("no cache-service instance answered")
