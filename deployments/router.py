"""Sticky conversation routing on Ray Serve's own extension point: a custom `RequestRouter`.

The ingress sends each turn as a `TurnJob` whose `owner` is the replica the cache service
names as the holder of the conversation's head. Serve calls `choose_replicas` with the live
replicas and tries the returned ranks in order, probing queue lengths; a rank whose replicas
are all full (`max_ongoing_requests`) is skipped:

    owner alive:   [[owner], [least loaded], [next], ...]   owner full -> the next rank takes it
    no owner / owner gone (not a candidate):  [[least loaded], [next], ...]

Load = the router's own count of requests it sent (Serve's queue-length cache), then the
worker's routing stats (`record_routing_stats`: running requests, free KV blocks) to break
ties and to see what other routers sent. A replica that takes a conversation it does not own
gets the head by the recovery ladder (tier import, else ledger recompute); see worker.py.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from deployments.protocol import TurnJob


def requested_owner(pending_request: PendingRequest | None) -> str:
    if pending_request is None:
        return ""
    for arg in [*pending_request.args, *pending_request.kwargs.values()]:
        if isinstance(arg, TurnJob):
            return arg.owner
    return ""


def load_key(queue_len: int | None, stats: dict[str, Any]) -> tuple[int, int, int, float]:
    """Smaller is less loaded: ongoing requests, then running requests, then more free blocks;
    a random last element spreads new conversations over equally idle replicas."""
    return (queue_len or 0, int(stats.get("running_requests", 0)), -int(stats.get("free_kv_blocks", 0)),
            random.random())


class StickyConversationRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every candidate is in the ranks below: if all are full, back off before retrying.
            pending_request.routing_context.should_backoff = True
        owner = requested_owner(pending_request)
        cache = self.replica_queue_len_cache
        by_load = sorted(candidate_replicas, key=lambda r: load_key(cache.get(r.replica_id), r.routing_stats))
        owned = [r for r in by_load if owner and r.replica_id.unique_id == owner]
        rest = [r for r in by_load if r not in owned]
        return [[r] for r in owned + rest]
