"""The sticky router's load count, on Serve's own router class and hooks, without a cluster:
a choice counts from the moment it is made until Serve counts the request it was made for,
never both at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Serve has no public constructor of a router's deployment id, handle source or request metadata.
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.router import StickyConversationRouter


@dataclass
class Candidate:
    """What `choose_replicas` reads of a `RunningReplica` (which needs a live actor)."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)


def _pending(n: int) -> PendingRequest:
    return PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}"))


async def test_a_request_sent_without_strict_routing_counts_once():
    """Serve's non-strict path calls `on_send_request` (which bumps its queue-length cache) and
    never `on_request_routed`: the choice must stop counting there, or the replica looks one
    request busier for CHOICE_TTL_S and the next conversation is steered away from it."""
    deployment = DeploymentID(name="Worker", app_name="router-test")
    router = StickyConversationRouter(deployment, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    a = Candidate(ReplicaID("a", deployment))
    b = Candidate(ReplicaID("b", deployment), {"free_kv_blocks": 100})  # wins a tie on load
    router.on_new_queue_len_info(b.replica_id, 2)  # b runs two requests

    ranks = await router.choose_replicas([a, b], _pending(1))
    assert ranks[0] == [a]
    router.on_send_request(a.replica_id)  # a now runs one: less loaded than b

    ranks = await router.choose_replicas([a, b], _pending(2))
    assert ranks[0] == [a], "the request sent to a was counted twice"
    router.on_send_request(a.replica_id)  # two each now: the tie goes to b's free blocks
    assert (await router.choose_replicas([a, b], _pending(3)))[0] == [b]
