"""How the app's processes talk to the cache service: one client configuration for all."""

from __future__ import annotations

from cache_service.client import ClientConfig, RetryPolicy
from deployments.settings import AppSettings

# Enough retries to ride out a cache-service or Redis restart without failing the turn.
CLIENT_RETRY = RetryPolicy(attempts=60, initial_backoff_s=0.02, max_backoff_s=0.5)
# Longer than the service's own try at a call (a 5 s Redis timeout, retried twice): a shorter
# deadline would leave the caller guessing about mutations the service is still making.
CALL_DEADLINE_S = 20.0


def cache_client_config(holder_prefix: str, settings: AppSettings) -> ClientConfig:
    return ClientConfig(timeout_s=CALL_DEADLINE_S, holder_prefix=holder_prefix, retry=CLIENT_RETRY,
                        auth_token=settings.read_cache_service_token())
