"""Fixtures: a real redis-server and a real `python -m cache_service` process.

One Redis and one service are shared by the session; tests that kill things start
their own (see ServiceProcess / EmbeddedRedis). Readiness is awaited from the
processes' own log lines, never by sleeping.
"""

from __future__ import annotations

import uuid

import grpc
import pytest
from cs_helpers import STRICT_STAGED_BYTES, STRICT_TIER_BUDGET, STRICT_TOKEN, ServiceProcess, fast_client

from cache_service.config import FsyncPolicy
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from proto.contract import ConversationRef
from proto import cache_pb2_grpc


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path_factory.mktemp("redis"),
                                               fsync=FsyncPolicy.ALWAYS))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def service(redis_server, tmp_path_factory):
    proc = ServiceProcess(data_dir=tmp_path_factory.mktemp("service"), redis_url=redis_server.url)
    proc.start()
    yield proc
    try:
        assert proc.terminate() == 0
    finally:
        proc.close()


@pytest.fixture(scope="session")
async def client(service):
    async with fast_client(service.target) as c:
        await c.wait_ready()
        yield c


# A second service with small bounds and authentication on, on a Redis of its own (its constants
# are in cs_helpers: a test module cannot import them from here by the bare name `conftest`, which
# names whichever folder's conftest was loaded first).


@pytest.fixture(scope="session")
def strict_service(tmp_path_factory):
    data = tmp_path_factory.mktemp("strict")
    (data / "token").write_text(STRICT_TOKEN + "\n")
    proc = ServiceProcess(data_dir=data, redis_url=None, tier_budget=STRICT_TIER_BUDGET, extra_env={
        "CACHE_SERVICE_AUTH_TOKEN_FILE": str(data / "token"),
        "CACHE_MAX_STAGED_BYTES": str(STRICT_STAGED_BYTES),
        "CACHE_PUT_IDLE_TIMEOUT_S": "3",  # long enough for a loaded machine to fill the staging
    })
    proc.start()
    yield proc
    try:
        assert proc.terminate() == 0
    finally:
        proc.close()


@pytest.fixture(scope="session")
async def strict_client(strict_service):
    async with fast_client(strict_service.target, auth_token=STRICT_TOKEN) as c:
        await c.wait_ready()
        yield c


@pytest.fixture
def conv() -> ConversationRef:
    return ConversationRef(f"conv-{uuid.uuid4().hex}", salt=f"salt-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="session")
async def stub(service):
    """The raw generated stub: for tests that check wire-level status codes."""
    channel = grpc.aio.insecure_channel(service.target, options=[
        ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
    yield cache_pb2_grpc.CacheServiceStub(channel)
    await channel.close()
