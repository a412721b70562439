"""How a cache-service client behaves: deadlines, retries with backoff, chunk sizes, its secret;
and the bounds a service applies with its default flags. Imported through `cache_service.client`,
the service's face for the app."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from cache_service.config import Limits

# The bounds a service applies with its default flags (`--max-lease-ttl-ms` can lower one), for
# clients to check their input before a call instead of learning them from INVALID_ARGUMENT.
SERVICE_LIMITS = Limits()


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 10
    initial_backoff_s: float = 0.02
    max_backoff_s: float = 1.0
    multiplier: float = 2.0

    def backoff(self, attempt: int) -> float:
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** attempt)
        return random.uniform(cap / 2, cap)  # jitter: retrying clients spread out


@dataclass(frozen=True)
class ClientConfig:
    timeout_s: float = 5.0             # deadline of each unary attempt
    stream_timeout_s: float = 300.0    # deadline of each state put/get attempt
    chunk_bytes: int = 1 << 20         # chunk size when put_state gets one bytes object
    holder_prefix: str = "client"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_message_bytes: int = 64 << 20
    # The service's shared secret, when it requires one (ServerConfig.auth_token).
    auth_token: str | None = field(default=None, repr=False)
    max_remembered_leases: int = 4096  # proofs kept for callers that pass bare tokens
    max_ledger_page_restarts: int = 5  # a ledger rewritten mid-read is read again
    # Several instances (placement.py): how many hold each tier entry (placed_tier.py says why 2),
    # how often DNS names are resolved again, and how long an instance that answered UNAVAILABLE
    # is passed over before it is tried again.
    tier_copies: int = 2
    discovery_refresh_s: float = 5.0
    instance_down_s: float = 2.0

    def __post_init__(self) -> None:
        if self.tier_copies < 1 or self.discovery_refresh_s <= 0 or self.instance_down_s < 0:
            raise ValueError("need tier_copies >= 1, discovery_refresh_s > 0, instance_down_s >= 0")
