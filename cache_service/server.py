"""Process wiring: Redis (given or embedded), the tier, the gRPC server, health, shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cache_service.config import ServerConfig
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from cache_service.logs import fields
from cache_service.servicer import CacheServicer
from cache_service.store import MetadataStore
from cache_service.tier import StateTier
from proto import cache_pb2, cache_pb2_grpc

log = logging.getLogger("cache_service.server")
SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name


class CacheServer:
    """Start with `await start()`, stop with `await stop()`; `port` is the bound port."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.port: int | None = None
        self.embedded: EmbeddedRedis | None = None
        self._server: grpc.aio.Server | None = None
        self._store: MetadataStore | None = None
        self._health = health.aio.HealthServicer()

    async def start(self) -> int:
        cfg = self.config
        url = cfg.redis_url
        if url is None:
            self.embedded = EmbeddedRedis(EmbeddedRedisConfig(
                data_dir=Path(cfg.data_dir) / "redis", fsync=cfg.fsync))
            # Started from this (main) thread on purpose: the child's parent-death
            # signal is tied to the thread that forked it.
            self.embedded.start()
            url = self.embedded.url
        self._store = MetadataStore(url, cfg.redis_timeout_s)
        await self._store.ping()  # fail at start, not at the first request
        tier = StateTier(cfg.tier)
        size = cfg.limits.max_grpc_message_bytes
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            # A second server on the same port must fail loudly, not share it.
            ("grpc.so_reuseport", 0),
        ])
        cache_pb2_grpc.add_CacheServiceServicer_to_server(
            CacheServicer(self._store, tier, cfg.limits), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}")
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra=fields(host=cfg.host, port=self.port, redis=_redact(url),
                                         embedded_redis=self.embedded is not None,
                                         tier_dir=str(cfg.tier.directory),
                                         tier_budget_bytes=cfg.tier.memory_budget_bytes))
        return self.port

    async def stop(self) -> None:
        """Drain: report NOT_SERVING, let in-flight RPCs finish within the grace period."""
        log.info("stopping", extra=fields(grace_s=self.config.grace_s))
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.config.grace_s)
        if self._store is not None:
            await self._store.close()
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)
        log.info("stopped")


def _redact(url: str) -> str:
    # redis://user:password@host -> redis://***@host
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}***@{rest.split('@', 1)[1]}" if "@" in rest else url


async def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    server = CacheServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()
