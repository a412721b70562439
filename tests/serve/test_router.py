"""The sticky router's load count, on Serve's own router class and hooks, without a cluster:
a choice counts from the moment it is made until Serve counts the request it was made for,
never both at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Serve has no public constructor of a router's deployment id, handle source or request metadata.
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.messages import HeadRef, TurnJob
from deployments.routing.router import PREFIX_SLACK, StickyConversationRouter


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


def _job_request(n: int, *, owner: str = "", holders: tuple[str, ...] = ()) -> PendingRequest:
    head = HeadRef(1, 1, 10, "0" * 64, owner, 0) if owner else None
    job = TurnJob(f"req-{n}", [{"role": "user", "content": "hi"}], {}, "conv" if owner else None, head=head,
                  prefix_holders=holders)
    return PendingRequest(args=[job], kwargs={},
                          metadata=RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}"))


def _router_with_loads(**queue_lens: int) -> tuple[StickyConversationRouter, dict[str, Candidate]]:
    deployment = DeploymentID(name="Worker", app_name="router-test")
    router = StickyConversationRouter(deployment, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    replicas = {}
    for name, queue_len in queue_lens.items():
        replicas[name] = Candidate(ReplicaID(name, deployment))
        router.on_new_queue_len_info(replicas[name].replica_id, queue_len)
    return router, replicas


def _names(ranks) -> list[str]:
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


async def test_prefix_holders_come_first_least_loaded_of_them_first():
    router, r = _router_with_loads(a=0, b=1, c=2, d=3)
    ranks = await router.choose_replicas(list(r.values()), _job_request(1, holders=("c", "b", "gone")))
    assert _names(ranks) == ["b", "c", "a", "d"]


async def test_a_holder_busier_than_the_slack_allows_is_ranked_by_load():
    router, r = _router_with_loads(a=0, b=PREFIX_SLACK, c=PREFIX_SLACK + 1)
    assert _names(await router.choose_replicas(list(r.values()), _job_request(1, holders=("b",))))[0] == "b"
    router, r = _router_with_loads(a=0, b=PREFIX_SLACK, c=PREFIX_SLACK + 1)
    assert _names(await router.choose_replicas(list(r.values()), _job_request(1, holders=("c",)))) == ["a", "b", "c"]
    router, r = _router_with_loads(a=0, b=PREFIX_SLACK, c=PREFIX_SLACK + 1)
    # only the holders within the slack go first
    assert _names(await router.choose_replicas(list(r.values()), _job_request(1, holders=("b", "c")))) == [
        "b", "a", "c"]


async def test_choices_count_towards_the_slack():
    """One hot prompt, many new conversations arriving at once: the holder takes them until it
    is PREFIX_SLACK choices ahead, then the others do (and hold the prefix from then on)."""
    router, r = _router_with_loads(a=0, b=0)
    firsts = [_names(await router.choose_replicas(list(r.values()), _job_request(n, holders=("a",))))[0]
              for n in range(PREFIX_SLACK + 2)]
    assert firsts == ["a"] * (PREFIX_SLACK + 1) + ["b"]


async def test_the_owner_still_wins_over_prefix_holders():
    router, r = _router_with_loads(a=0, b=5, c=1)
    ranks = await router.choose_replicas(list(r.values()), _job_request(1, owner="b", holders=("c",)))
    assert _names(ranks) == ["b", "a", "c"]  # holders only matter without an owner
    router, r = _router_with_loads(a=0, b=5, c=1)
    ranks = await router.choose_replicas([r["a"], r["c"]], _job_request(2, owner="b", holders=("c",)))
    assert _names(ranks) == ["c", "a"]  # the owner is gone: the holder goes first
