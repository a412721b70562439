"""The service as a whole: a supervised Redis and honest health, malformed wire messages,
and the shared-secret option."""

import asyncio
import os
import signal

import grpc
import pytest
from cs_helpers import History, ServiceProcess, commit_turn, fast_client
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.client import CacheClient, ClientConfig, InvalidArgument, Unauthenticated
from cache_service.config import FsyncPolicy
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from cache_service.errors import from_status
from cache_service.server import SERVICE_NAME
from proto.contract import ConversationRef

# Processes get killed here; a hang must fail fast, not eat the session timeout.
pytestmark = pytest.mark.timeout(60)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthWatch:
    """The service's own health stream (grpc.health.v1 Watch): awaits transitions."""

    def __init__(self, target: str):
        self._channel = grpc.aio.insecure_channel(target)
        self._stream = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME))

    async def next_status(self, timeout_s: float = 20.0) -> int:
        return (await asyncio.wait_for(self._stream.read(), timeout_s)).status

    async def until(self, status: int, timeout_s: float = 20.0) -> None:
        while await self.next_status(timeout_s) != status:
            pass

    async def close(self) -> None:
        self._stream.cancel()
        await self._channel.close()


@pytest.fixture
def supervised_env():
    return {"CACHE_HEALTH_INTERVAL_S": "0.1"}


async def test_a_killed_embedded_redis_is_restarted_and_health_says_so(tmp_path, supervised_env):
    proc = ServiceProcess(data_dir=tmp_path, redis_url=None, extra_env=supervised_env)
    proc.start()
    conv = ConversationRef("supervised", "s")
    watch = HealthWatch(proc.target)
    try:
        async with fast_client(proc.target) as client:
            history = History()
            await commit_turn(client, conv, history, [1, 2], "before the crash")
            assert await watch.next_status() == SERVING
            os.kill(proc.event("embedded_redis_started")["pid"], signal.SIGKILL)
            await watch.until(NOT_SERVING)
            await watch.until(SERVING)  # restarted from its AOF, on the same port
            ledger = await client.read_ledger(conv)
            assert [list(t.token_ids) for t in ledger.turns] == [[1, 2]]
            await commit_turn(client, conv, history, [3], "after the restart")
    finally:
        await watch.close()
        proc.close()


async def test_health_follows_an_external_redis(tmp_path, supervised_env):
    redis_server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path / "redis", fsync=FsyncPolicy.ALWAYS))
    redis_server.start()
    proc = ServiceProcess(data_dir=tmp_path / "svc", redis_url=redis_server.url, extra_env=supervised_env)
    proc.start()
    watch = HealthWatch(proc.target)
    try:
        assert await watch.next_status() == SERVING
        redis_server.kill()
        await watch.until(NOT_SERVING)  # not restarted by the service: it is not its Redis
        redis_server.start()
        await watch.until(SERVING)
        async with fast_client(proc.target) as client:
            await commit_turn(client, ConversationRef("external", "s"), History(), [1], "back")
    finally:
        await watch.close()
        proc.close()
        redis_server.stop()


@pytest.mark.parametrize("method, streaming", [("GetHead", False), ("PublishTurn", False),
                                               ("PutState", True)])
async def test_malformed_messages_are_invalid_argument(service, method, streaming):
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length far past the end
    async with grpc.aio.insecure_channel(service.target) as channel:
        path = f"/hybridserve.cache.v1.CacheService/{method}"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if streaming:
                async def one():
                    yield garbage
                await channel.stream_unary(path)(one())
            else:
                await channel.unary_unary(path)(garbage)
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "malformed" in error.details()
    typed = from_status(error.code(), error.details(), error.trailing_metadata())
    assert isinstance(typed, InvalidArgument)


async def test_the_shared_secret_is_required_when_configured(strict_service, strict_client):
    conv = ConversationRef("auth", "s")
    await commit_turn(strict_client, conv, History(), [1], "authenticated")
    for token in (None, "wrong-secret-but-long-enough"):
        async with CacheClient(strict_service.target, ClientConfig(auth_token=token)) as anonymous:
            with pytest.raises(Unauthenticated):
                await anonymous.get_head(conv)
            with pytest.raises(Unauthenticated):
                await anonymous.acquire_lease(ConversationRef("intruder", "s"), ttl_ms=60_000)
            with pytest.raises(Unauthenticated):
                await anonymous.get_state(conv)
    # Health probes (Kubernetes) need no secret.
    async with grpc.aio.insecure_channel(strict_service.target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == SERVING
    await strict_client.acquire_lease(ConversationRef("intruder", "s"), ttl_ms=60_000)  # not held by the intruder
