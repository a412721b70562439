"""A burst of calls larger than gRPC's pending-call backlog: every call gets the service's verdict.

gRPC core cancels calls its server has received but not yet handed to the application once more
than 1,000 wait (at random up to 3,000, then all): the client sees a bare CANCELLED
(Interrupted, not retried). A router opening thousands of sessions at once met that (bench.scale,
the first second of every overloaded point). The service raises that backlog
(ServerConfig.max_pending_rpcs), so a burst queues within its deadlines instead.
"""

import asyncio
import collections
import uuid

import pytest

from cache_service.client import CacheClient, ClientConfig
from proto.contract import ConversationRef

pytestmark = pytest.mark.timeout(180)

# Past gRPC's hard default of 3,000: without the raised backlog a good share is cancelled.
BURST = 4000


async def test_a_burst_past_grpcs_pending_backlog_is_answered_not_cancelled(service):
    # One channel, as a router has; a deadline long enough for a loaded machine to work through
    # the queue, so only a cancellation (not a timeout) can fail a call here.
    async with CacheClient(service.target, ClientConfig(timeout_s=150.0)) as client:
        await client.wait_ready()
        convs = [ConversationRef(f"burst-{uuid.uuid4().hex}", "s") for _ in range(BURST)]
        results = await asyncio.gather(*(client.acquire_lease(c, ttl_ms=60_000) for c in convs),
                                       return_exceptions=True)
    failures = collections.Counter(type(r).__name__ for r in results if isinstance(r, BaseException))
    assert not failures, f"{sum(failures.values())} of {BURST} acquires failed: {dict(failures)}"
    assert all(r.token > 0 and r.head.version == 0 for r in results)
