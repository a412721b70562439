"""What the ingress knows of the worker replicas' engines between requests: the routing stats
each replica reports (`Worker.record_routing_stats`, every request_routing_stats_period_s), as
the sticky routers of this process last received them from Serve's controller.

Serve gives routing stats to the request router only; the routers register here so /metrics can
read them (vllm:kv_cache_usage_perc) without a call to every replica at each scrape.
"""

from __future__ import annotations

import weakref
from typing import Any

_routers: weakref.WeakSet = weakref.WeakSet()


def register(router: Any) -> None:
    """A router of this process (one per deployment handle that has routed a request)."""
    _routers.add(router)


def replica_stats() -> list[dict[str, Any]]:
    """The latest routing stats of every replica known to this process's routers."""
    seen: dict[Any, dict[str, Any]] = {}
    for router in list(_routers):
        for replica_id, replica in router.curr_replicas.items():
            seen[replica_id] = replica.routing_stats or {}
    return list(seen.values())


def kv_cache_usage() -> float:
    """The mean fraction of KV cache blocks in use over the replicas reporting it (0: none yet)."""
    usage = [float(s["kv_cache_usage"]) for s in replica_stats() if "kv_cache_usage" in s]
    return sum(usage) / len(usage) if usage else 0.0
