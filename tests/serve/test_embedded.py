"""The embedded default (README command 1): no cache-service address, no Redis URL. The app
starts `python -m cache_service` itself (CacheService deployment), which starts its own Redis."""

from __future__ import annotations

import asyncio

import openai
import pytest
from ray import serve

from cache_service.client import CacheClient, Unauthenticated
from deployments.app import build_app
from deployments.service.connection import CacheConnection
from deployments.settings import AppSettings
from tests.serve.helpers import chat_turn, user

pytestmark = pytest.mark.timeout(300)
EMBEDDED_APP = "hybridserve-embedded"


async def test_the_app_starts_its_own_cache_service_and_redis(stack, tmp_path, conv_id):
    args = {"model": stack.model_dir, "data_dir": str(tmp_path / "data"), "kv_cache_mb": 16, "head_cache_mb": 8}
    serve.run(build_app(args), name=EMBEDDED_APP, route_prefix="/embedded")
    try:
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/embedded/v1", api_key="unused", max_retries=0,
                                    timeout=120)
        first = await chat_turn(client, stack.model, [user("hi")], conversation_id=conv_id, cache_salt="e")
        second = await chat_turn(client, stack.model, [user("again")], conversation_id=conv_id, cache_salt="e")
        assert (first.turn, second.turn) == (1, 2) and second.cached_tokens > 0
        assert any((tmp_path / "data" / "redis").iterdir())  # the embedded Redis keeps its AOF there

        # It listens on the node's address: without a configured secret it makes its own.
        host = serve.get_deployment_handle("CacheService", EMBEDDED_APP)
        address, secret = await host.endpoint.remote()
        assert len(secret) >= 32
        async with CacheClient(address) as anonymous:
            with pytest.raises(Unauthenticated):
                await anonymous.stats()

        # Concurrent first uses of a process's connection share one client (one heartbeat loop).
        made: list[CacheClient] = []
        connection = CacheConnection(AppSettings(**args), host, "test", made.append)
        clients = await asyncio.gather(*[connection.get() for _ in range(8)])
        try:
            assert len(made) == 1 and all(c is made[0] for c in clients)
            assert (await clients[0].stats()).tier_budget_bytes > 0  # with the service's secret
        finally:
            for c in set(clients):
                await c.close()
    finally:
        serve.delete(EMBEDDED_APP)
