"""Why each request went where it went: `hybridserve_route_decisions_total{reason}`.

The router runs inside the process that holds the workers' handle (the ingress), so its counter
lives in a registry of its own there, which the ingress's `/metrics` exports with its own.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from deployments.routing.cost import RouteReason

ROUTING_REGISTRY = CollectorRegistry()
_DECISIONS = Counter("hybridserve_route_decisions", "turns routed, by why the replica was chosen: owner (holds the "
                     "head), owner_busy_moved (the head moved: its owner's queue cost more than an import, or it "
                     "was full), owner_gone, prefix_holder (holds the longest known prefix), prefix_holder_busy "
                     "(holders' queues cost more than recomputing the prefix, or they were full), prefix_computing "
                     "(nobody holds it yet; an earlier request sharing it computes it there), prefix_import (the "
                     "state tier's copy of the prefix imported there: cheaper than any holder or computing it), "
                     "least_loaded (nobody holds any of it)",
                     ["reason"], registry=ROUTING_REGISTRY)
for _reason in RouteReason:
    _DECISIONS.labels(_reason.value)  # exported from the start (rate() needs the zero)


def count_decision(reason: RouteReason) -> None:
    _DECISIONS.labels(reason.value).inc()
