"""How the app's processes talk to the cache service: one client configuration for all, and one
client per process.

    settings.cache_service set:  that address, the secret of cache_service_token_file (if any)
    else:                        the CacheService deployment's address and the secret it gave
                                 the service it started (its own, random, unless a file is set)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cache_service.client import CacheClient, ClientConfig, RetryPolicy
from deployments.settings import AppSettings

# Enough retries to ride out a cache-service or Redis restart without failing the turn.
CLIENT_RETRY = RetryPolicy(attempts=60, initial_backoff_s=0.02, max_backoff_s=0.5)
# Longer than the service's own try at a call (a 5 s Redis timeout, retried twice): a shorter
# deadline would leave the caller guessing about mutations the service is still making.
CALL_DEADLINE_S = 20.0


def cache_client_config(holder_prefix: str, settings: AppSettings, auth_token: str | None = None) -> ClientConfig:
    return ClientConfig(timeout_s=CALL_DEADLINE_S, holder_prefix=holder_prefix, retry=CLIENT_RETRY,
                        auth_token=auth_token or settings.read_cache_service_token())


class CacheConnection:
    """A process's one CacheClient, made on first use. Concurrent first uses wait for the same
    client: two would each start their own heartbeats and registrations."""

    def __init__(self, settings: AppSettings, cache_host, holder_prefix: str,
                 on_connect: Callable[[CacheClient], None] | None = None):
        self.settings, self.cache_host, self.holder_prefix = settings, cache_host, holder_prefix
        self.on_connect = on_connect
        self.client: CacheClient | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> CacheClient:
        if self.client is None:
            async with self._lock:
                if self.client is None:
                    self.client = await self._connect()
                    if self.on_connect is not None:
                        self.on_connect(self.client)
        return self.client

    async def _connect(self) -> CacheClient:
        if self.settings.cache_service:
            address, token = self.settings.cache_service, None
        else:
            address, token = await self.cache_host.endpoint.remote()
        return CacheClient(address, cache_client_config(self.holder_prefix, self.settings, token))
