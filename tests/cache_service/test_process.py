"""`python -m cache_service` as a process: embedded Redis, health, graceful shutdown."""

import os
import select

import grpc
import pytest
from cs_helpers import SERVICE_ROOT, History, ServiceProcess, commit_turn, fast_client
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.launch import CacheServiceChild, ServiceDidNotStart
from cache_service.server import SERVICE_NAME
from proto.contract import ConversationRef

# Processes get killed here; a hang must fail fast, not eat the session timeout.
pytestmark = pytest.mark.timeout(60)


def wait_for_exit(pid: int, timeout_s: float = 10.0) -> bool:
    """True once pid (not our child) has exited; waits on a pidfd, no polling."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


async def health_status(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status


@pytest.fixture
def embedded_service(tmp_path):
    proc = ServiceProcess(data_dir=tmp_path, redis_url=None)
    yield proc
    proc.close()


async def test_embedded_redis_default_persists_across_restarts(embedded_service, tmp_path):
    proc = embedded_service
    conv = ConversationRef("embedded", salt="s")
    history = History()

    proc.start()
    redis_pid = proc.event("embedded_redis_started")["pid"]
    assert proc.event("serving")["embedded_redis"] is True
    assert (tmp_path / "redis" / "appendonly.aof").exists()
    for name in ("", SERVICE_NAME):
        assert await health_status(proc.target, name) == health_pb2.HealthCheckResponse.SERVING
    async with fast_client(proc.target) as client:
        await commit_turn(client, conv, history, [1, 2], "before restart")

    assert proc.terminate() == 0  # SIGTERM: graceful, exit code 0
    assert proc.event("stopped")
    assert wait_for_exit(redis_pid), "the embedded redis-server outlived the service"

    # Same data directory: the new embedded Redis replays the AOF.
    proc.events.clear()
    proc.start()
    assert proc.event("embedded_redis_started")["pid"] != redis_pid
    async with fast_client(proc.target) as client:
        ledger = await client.read_ledger(conv)
        assert [list(t.token_ids) for t in ledger.turns] == [[1, 2]]
        await commit_turn(client, conv, History(tokens=[1, 2], version=1), [3], "after restart")

    # Even a SIGKILLed service takes its redis-server down with it (parent-death signal).
    redis_pid = proc.event("embedded_redis_started")["pid"]
    proc.kill()
    assert wait_for_exit(redis_pid), "the embedded redis-server outlived a killed service"


def test_an_empty_auth_token_file_refuses_to_start(tmp_path):
    """Asked for authentication, the service must not run without it because the file is empty."""
    token = tmp_path / "token"
    token.write_text("\n")
    child = CacheServiceChild(["--port", "0", "--data-dir", str(tmp_path), "--auth-token-file", str(token)],
                              root=SERVICE_ROOT)
    try:
        with pytest.raises(ServiceDidNotStart, match="is empty"):
            child.start(30)
        assert child.proc.wait(10) == 2
    finally:
        child.stop()
