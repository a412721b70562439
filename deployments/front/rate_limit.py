"""A per-API-key request rate limit (`rate_limit_rpm`, off by default): a token bucket per key,
refilled at rpm / 60 requests a second and holding at most a minute's worth (rpm), so a key may
burst up to rpm requests and then keeps to the rate.

A request over the limit gets a 429 `rate_limit_exceeded` with `Retry-After` (seconds until the
key's next request fits), distinct from the 503 `overloaded` of a full server: a 429 is this
key's doing and goes away at the key's own pace, a 503 is everyone's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

MAX_KEYS = 100_000  # buckets kept; beyond it the full ones (idle for a minute) are dropped


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    def __init__(self, requests_per_minute: int, clock=time.monotonic):
        self.rpm = requests_per_minute
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def retry_after(self, key: str) -> int | None:
        """Take one request of `key`'s allowance: None if it fits, else the whole seconds until
        one would."""
        now = self._clock()
        rate = self.rpm / 60.0
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_KEYS:
                self._drop_full(now)
            bucket = self._buckets[key] = _Bucket(float(self.rpm), now)
        bucket.tokens = min(float(self.rpm), bucket.tokens + (now - bucket.at) * rate)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - bucket.tokens) / rate))

    def _drop_full(self, now: float) -> None:
        full_after = 60.0  # an idle minute refills any bucket: forgetting it changes nothing
        for key in [k for k, b in self._buckets.items() if now - b.at >= full_after]:
            del self._buckets[key]
