"""Process wiring: Redis (given or embedded), the tier, the gRPC server, health, shutdown.

Supervision: a probe pings Redis every `health_interval_s`. While Redis does not
answer, gRPC health reports NOT_SERVING (the Redis-backed calls answer UNAVAILABLE
meanwhile, and clients retry); once it answers again, SERVING. An embedded
redis-server that exited is restarted on the same port from its AOF.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from redis.exceptions import RedisError
from redis.utils import HIREDIS_AVAILABLE

from cache_service import wire
from cache_service.config import ServerConfig
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from cache_service.leases import LeaseSigner
from cache_service.logs import fields
from cache_service.redis_connect import connect
from cache_service.replica_wait import ReplicaWait
from cache_service.servicer import CacheServicer
from cache_service.store import MetadataStore
from cache_service.tier import StateTier
from proto import cache_pb2

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
        self._serving = False
        self._supervisor: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        self._servicer: CacheServicer | None = None

    async def start(self) -> int:
        cfg = self.config
        target = cfg.redis_target
        if target is None:
            self.embedded = EmbeddedRedis(EmbeddedRedisConfig(
                data_dir=Path(cfg.data_dir) / "redis", fsync=cfg.fsync, maxmemory_bytes=cfg.redis_maxmemory_bytes))
            # Started from this (main) thread on purpose: the child's parent-death
            # signal is tied to the thread that forked it.
            self.embedded.start()
            target = self.embedded.url
        self._store = MetadataStore(connect(target, cfg.redis_timeout_s), cfg.conversation_ttl_ms,
                                    ReplicaWait(cfg.publish_wait_replicas, cfg.publish_wait_timeout_ms))
        await self._store.ping()  # fail at start, not at the first request
        await self._check_eviction_policy()
        signer = LeaseSigner(await self._store.lease_key())
        tier = StateTier(cfg.tier, prefix_ttl_s=cfg.prefix_ttl_s)
        size = cfg.limits.max_grpc_message_bytes
        interceptors = [wire.SharedSecretInterceptor(cfg.auth_token)] if cfg.auth_token else []
        self._server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            # A second server on the same port must fail loudly, not share it.
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", cfg.max_pending_rpcs),
            ("grpc.server.max_pending_requests_hard_limit", cfg.max_pending_rpcs),
        ])
        self._servicer = CacheServicer(self._store, tier, signer, limits=cfg.limits, puts=cfg.puts,
                                       fence_ttl_ms=cfg.fence_ttl_ms, prefix_ttl_ms=round(cfg.prefix_ttl_s * 1000),
                                       placement=cfg.tier_placement)
        wire.add_servicer(self._servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}")
        await self._server.start()
        await self._set_serving(True)
        self._supervisor = asyncio.create_task(self._supervise(), name="redis-supervisor")
        self._sweeper = asyncio.create_task(self._sweep_tier(), name="tier-sweeper")
        log.info("serving", extra=fields(host=cfg.host, port=self.port, redis=_redact(str(target)),
                                         wait_replicas=cfg.publish_wait_replicas,
                                         embedded_redis=self.embedded is not None,
                                         tier_dir=str(cfg.tier.directory),
                                         tier_budget_bytes=cfg.tier.memory_budget_bytes,
                                         prefix_tier_bytes=cfg.tier.prefix_budget_bytes,
                                         prefix_ttl_s=cfg.prefix_ttl_s,
                                         tier_placement=cfg.tier_placement.value,
                                         auth=cfg.auth_token is not None,
                                         conversation_ttl_s=cfg.conversation_ttl_s,
                                         event_loop=type(asyncio.get_running_loop()).__module__,
                                         redis_parser="hiredis" if HIREDIS_AVAILABLE else "python"))
        return self.port

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)
        if serving != self._serving:
            log.log(logging.INFO if serving else logging.WARNING, "health",
                    extra=fields(serving=serving))
        self._serving = serving

    async def _redis_answers(self) -> bool:
        try:
            await asyncio.wait_for(self._store.ping(), max(4 * self.config.health_interval_s, 1.0))
            return True
        except (OSError, asyncio.TimeoutError, RedisError):
            return False

    async def _check_eviction_policy(self) -> None:
        """An external Redis that may evict would drop leases and heads silently: say so loudly
        (not refused: managed Redis services may not allow CONFIG GET)."""
        try:
            policy = await self._store.eviction_policy()
        except RedisError as exc:
            log.warning("redis_policy_unknown", extra=fields(error=str(exc)))
            return
        if policy != "noeviction":
            log.error("redis_may_evict", extra=fields(
                maxmemory_policy=policy, expected="noeviction",
                reason="an evicting Redis drops leases and heads silently; set maxmemory-policy noeviction"))

    async def _sweep_tier(self) -> None:
        """Tier entries follow their conversation: once its head expired, the entry goes. Prefix
        checkpoints past their TTL go too (their names withdrawn from the index)."""
        while True:
            await asyncio.sleep(self.config.tier_sweep_interval_s)
            try:
                expired = await self._servicer.hints.sweep()
                dropped = await self._servicer.sweep_tier()
            except (OSError, RedisError) as exc:  # Redis away: the next sweep tries again
                log.warning("tier_sweep_failed", extra=fields(error=str(exc)))
                continue
            except Exception:  # a sweeper that died would let the tier keep what expired, unseen
                log.exception("tier_sweep_error")
                continue
            if dropped or expired:
                log.info("tier_swept", extra=fields(dropped=dropped, prefixes_expired=expired))

    async def _supervise(self) -> None:
        """Probe Redis periodically: health follows it, a dead embedded Redis is restarted."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            if self.embedded is not None and not self.embedded.running:
                await self._set_serving(False)
                log.warning("embedded_redis_died", extra=fields(port=self.embedded.port))
                try:
                    await self.embedded.restart()
                except RuntimeError as exc:
                    log.error("embedded_redis_restart_failed", extra=fields(error=str(exc)))
                    continue
            answers = await self._redis_answers()
            if answers != self._serving:
                await self._set_serving(answers)

    async def stop(self) -> None:
        """Drain: report NOT_SERVING, let in-flight RPCs finish within the grace period."""
        log.info("stopping", extra=fields(grace_s=self.config.grace_s))
        await self._health.enter_graceful_shutdown()
        for task in (self._supervisor, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
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
