"""One decorator for every RPC handler: typed errors -> status codes, counters, logs.

A handler raises CacheError subclasses (or lets a Redis connection error escape);
the decorator aborts the RPC with the error's code and "hs-reason" trailing metadata,
counts the call and logs one structured line. Works for unary handlers, for
server-streaming handlers (async generators) and for client-streaming ones (the
request is an async iterator). A request that did not parse (wire.Malformed) is
refused here as INVALID_ARGUMENT, in a stream as soon as the bad message arrives.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import logging

import grpc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import AskError, ClusterError, OutOfMemoryError, ResponseError, SlotNotCoveredError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cache_service import errors
from cache_service.logs import fields, monotonic_ms
from cache_service.wire import Malformed

log = logging.getLogger("cache_service.rpc")


class RpcCounters:
    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()


def is_out_of_memory(exc: BaseException) -> bool:
    """Redis refused a write over its maxmemory: a bare command's OOM error, or a script's
    (which Redis reports as a script error carrying "-OOM ...")."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and "OOM command not allowed" in str(exc))


# A Redis Cluster mid-failover: the slot's primary is down (CLUSTERDOWN), not yet known (a
# redirect past the client's retries, TRYAGAIN), or no node serves the slot yet. All pass.
_CLUSTER_IN_FLUX = (ClusterError, AskError, TryAgainError, SlotNotCoveredError)


def is_closed_transport(exc: BaseException) -> bool:
    """A write on a Redis connection its peer had closed (a primary killed mid-failover), as
    uvloop reports it: a RuntimeError, which redis-py lets through (asyncio's own loop drops such
    a write silently, and the read then fails as a ConnectionError). The command never left, so
    it is the same as a lost connection: retrying is safe."""
    return isinstance(exc, RuntimeError) and "handler is closed" in str(exc)


def _as_cache_error(exc: BaseException) -> errors.CacheError | None:
    if isinstance(exc, errors.CacheError):
        return exc
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)) or is_closed_transport(exc):
        return errors.Unavailable(f"redis unavailable: {exc}")
    if isinstance(exc, _CLUSTER_IN_FLUX):
        return errors.Unavailable(f"the Redis Cluster is failing over: {type(exc).__name__}: {exc}")
    if is_out_of_memory(exc):
        return errors.StorageFull("the cache service's Redis is full (its maxmemory is reached): the write was "
                                  "refused and nothing changed; reads go on, and writes once conversations expire "
                                  "or are deleted")
    return None


async def _abort(context: grpc.aio.ServicerContext, name: str, exc: errors.CacheError,
                 counters: RpcCounters, started: float) -> None:
    counters.errors[f"{name}:{exc.code.name}"] += 1
    level = logging.WARNING if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS) \
        else logging.DEBUG
    log.log(level, "rpc_error", extra=fields(rpc=name, code=exc.code.name, reason=exc.reason.value,
                                             message=exc.message, ms=round(monotonic_ms() - started, 3)))
    await context.abort(exc.code, exc.message, trailing_metadata=exc.trailing_metadata())


def _malformed(value: Malformed) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"malformed protobuf message: {value.error}")


def _checked(request):
    if isinstance(request, Malformed):
        raise _malformed(request)
    if hasattr(request, "__aiter__"):
        return _checked_stream(request)
    return request


async def _checked_stream(requests):
    async for message in requests:
        if isinstance(message, Malformed):
            raise _malformed(message)
        yield message


def rpc(handler):
    """Decorate a servicer method `(self, request, context)`; self must have `counters`."""
    name = handler.__name__

    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream(self, request, context):
            started = monotonic_ms()
            self.counters.calls[name] += 1
            try:
                async for item in handler(self, _checked(request), context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped or re-raised just below
                mapped = _as_cache_error(exc)
                if mapped is None:
                    raise
                await _abort(context, name, mapped, self.counters, started)
        return stream

    @functools.wraps(handler)
    async def unary(self, request, context):
        started = monotonic_ms()
        self.counters.calls[name] += 1
        try:
            reply = await handler(self, _checked(request), context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised just below
            mapped = _as_cache_error(exc)
            if mapped is None:
                raise
            await _abort(context, name, mapped, self.counters, started)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rpc", extra=fields(rpc=name, ms=round(monotonic_ms() - started, 3)))
        return reply
    return unary
