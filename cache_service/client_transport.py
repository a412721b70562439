"""How a client's call reaches an instance: channels, deadlines, retries, typed errors.

A call that may go to any instance (`retrying`, `unary`, `once`) goes to the pool's live choice;
one answering UNAVAILABLE is marked down, so the retry goes to another (with one instance the
retry simply tries it again, as it always did). `on(address)` runs one attempt on a chosen
instance, for the state tier's placed reads and writes (placed_tier.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from cache_service.client_config import ClientConfig
from cache_service.errors import Interrupted, Unavailable, from_status
from cache_service.instances import InstancePool
from cache_service.placement import parse_targets
from cache_service.wire import bearer
from proto import cache_pb2_grpc

Stub = cache_pb2_grpc.CacheServiceStub
Attempt = Callable[[Stub], Any]  # one call on a stub, awaitable


def typed(exc: grpc.aio.AioRpcError, *, stream: bool = False) -> BaseException:
    """The typed error of a failed call (the gRPC error itself for a status we do not map). For
    the (idempotent) state streams a bare INTERNAL is UNAVAILABLE: what a stream cut by a
    service crash looks like."""
    error = from_status(exc.code(), exc.details() or "", exc.trailing_metadata())
    if isinstance(error, Interrupted) and stream and exc.code() == grpc.StatusCode.INTERNAL:
        error = Unavailable(f"state stream cut: {exc.details()}")
    return exc if error is None else error


class Transport:
    def __init__(self, target: str, config: ClientConfig):
        self.config = config
        self.pool = InstancePool(parse_targets(target), self._channel_to, refresh_s=config.discovery_refresh_s,
                                 down_s=config.instance_down_s)
        self.metadata = bearer(config.auth_token) if config.auth_token else None

    def _channel_to(self, address: str) -> grpc.aio.Channel:
        size = self.config.max_message_bytes
        return grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            # Reconnect quickly after a service restart (gRPC's default starts at 1 s
            # and grows to 120 s, far longer than a restart takes).
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])

    async def close(self) -> None:
        await self.pool.close()

    async def wait_ready(self, timeout_s: float) -> None:
        """Until one instance accepts connections."""
        async def first_ready() -> None:
            channels = [self.pool.stub(a) and self.pool.channel(a) for a in await self.pool.members()]
            waits = [asyncio.ensure_future(c.channel_ready()) for c in channels]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

        await asyncio.wait_for(first_ready(), timeout_s)

    async def retrying(self, attempt_fn: Attempt, *, stream: bool = False) -> Any:
        """Retry UNAVAILABLE (for the state streams also a cut stream, see `typed`), each attempt
        on a live instance."""
        policy = self.config.retry
        for attempt in range(policy.attempts):
            address = None
            try:
                address = await self.pool.any()
                return await attempt_fn(self.pool.stub(address))
            except grpc.aio.AioRpcError as exc:
                error = typed(exc, stream=stream)
                if error is exc:
                    raise
                if not isinstance(error, Unavailable) or attempt == policy.attempts - 1:
                    raise error from exc
            except Unavailable:  # DNS named no instance yet
                if attempt == policy.attempts - 1:
                    raise
            if address is not None:
                self.pool.mark_down(address)
            await asyncio.sleep(policy.backoff(attempt))
        raise AssertionError("unreachable")

    async def unary(self, method: str, request) -> Any:
        return await self.retrying(lambda stub: getattr(stub, method)(request, timeout=self.config.timeout_s,
                                                                        metadata=self.metadata))

    async def once(self, method: str, request, timeout_s: float, address: str | None = None) -> Any:
        """One attempt (on `address`, else on a live instance), no retries; errors typed."""
        address = address or await self.pool.any()
        return await self.on(address)(lambda stub: getattr(stub, method)(request, timeout=timeout_s,
                                                                          metadata=self.metadata))

    def on(self, address: str) -> Callable[..., Any]:
        """Runs one attempt on `address`, its error typed; UNAVAILABLE marks the instance down."""
        async def run(attempt_fn: Attempt, *, stream: bool = False) -> Any:
            try:
                return await attempt_fn(self.pool.stub(address))
            except grpc.aio.AioRpcError as exc:
                error = typed(exc, stream=stream)
                if isinstance(error, Unavailable):
                    self.pool.mark_down(address)
                if error is exc:
                    raise
                raise error from exc
        return run
