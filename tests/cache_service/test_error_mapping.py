"""Errors a Redis client lets through are mapped to the status a client can act on.

uvloop (the service's event loop) refuses a write on a transport its peer closed with a bare
RuntimeError, which redis-py passes up as it is: a primary killed mid-failover then reached the
client as UNKNOWN "Unexpected RuntimeError" (the Redis Cluster failover test, once in a full run)
instead of UNAVAILABLE, which it retries."""

import asyncio
import socket

import uvloop

from cache_service import errors
from cache_service.rpc import _as_cache_error


async def _write_after_close() -> RuntimeError:
    """The error uvloop itself raises for a write on a closed TCP transport."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        _, writer = await asyncio.open_connection(*listener.getsockname())
        writer.close()
        await writer.wait_closed()  # the transport's handle is released: what a lost peer leaves
        try:
            writer.transport.write(b"PING\r\n")
        except RuntimeError as error:
            return error
    raise AssertionError("uvloop accepted a write on a closed transport")


def test_a_write_on_a_closed_redis_connection_is_unavailable():
    closed = uvloop.run(_write_after_close())
    mapped = _as_cache_error(closed)
    assert isinstance(mapped, errors.Unavailable), (closed, mapped)


def test_another_runtime_error_is_not_taken_for_a_lost_connection():
    assert _as_cache_error(RuntimeError("dictionary changed size during iteration")) is None
