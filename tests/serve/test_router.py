"""The sticky router's load count, on Serve's own router class and hooks, without a cluster:
a choice counts from the moment it is made until Serve counts the request it was made for,
never both at once."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

# Serve has no public constructor of a router's deployment id, handle source or request metadata.
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata, RunningReplicaInfo
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from deployments.messages import HeadRef, TurnJob
from deployments.routing.decisions import ROUTING_REGISTRY
from deployments.routing.router import StickyConversationRouter


@dataclass
class Candidate:
    """What `choose_replicas` reads of a `RunningReplica` (which needs a live actor)."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 64  # room for the queues these tests give, unless a test says otherwise


class SlowToAnswer(RunningReplica):
    """A live replica whose answer to Serve's queue-length probe takes `delay_s` (a busy
    worker's event loop on a loaded machine); no actor behind it."""

    def __init__(self, replica_id: ReplicaID, delay_s: float):
        self._replica_info = RunningReplicaInfo(replica_id, None, None, None, replica_id.unique_id, 8,
                                                routing_stats={})
        self._multiplexed_model_ids = set()
        self.delay_s = delay_s

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(self.delay_s)
        return 2


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


async def test_an_owner_slow_to_answer_the_queue_probe_is_not_skipped():
    """Serve probes a replica whose cached queue length expired and tries the next rank if the
    answer is late. An owner taking 0.3 s to answer (Serve's own deadline is 0.1 s) is busy, not
    gone: skipped, its conversation's turn would run elsewhere and import or recompute the head."""
    deployment = DeploymentID(name="Worker", app_name="router-test")
    router = StickyConversationRouter(deployment, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    owner = SlowToAnswer(ReplicaID("owner", deployment), 0.3)
    router.update_replicas([owner])
    chosen = await router._select_from_candidate_replicas([owner], 0)  # the first try of the owner's rank
    assert chosen is not None and chosen.replica_id == owner.replica_id


def _job_request(n: int, *, owner: str = "", holders: tuple[tuple[str, int], ...] = (), head_tokens: int = 1000,
                 tier_copy: bool = False, names: tuple[tuple[str, int], ...] = (),
                 tier: tuple[str, int] | None = None) -> PendingRequest:
    head = HeadRef(3, 3, head_tokens, "0" * 64, owner, 3 if tier_copy else 0) if owner else None
    job = TurnJob(f"req-{n}", [{"role": "user", "content": "hi"}], {}, "conv" if owner else None, head=head,
                  prefix_holders=holders, prefix_names=names, tier_prefix=tier)
    return PendingRequest(args=[job], kwargs={},
                          metadata=RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}"))


def _router(max_ongoing_requests: int = 64, **stats: dict[str, Any]) -> tuple[StickyConversationRouter, list[Candidate]]:
    """A router over replicas with the given routing stats, each as measured by its worker
    (speeds default to 1,000 prefill tokens/s), nothing sent to any yet."""
    deployment = DeploymentID(name="Worker", app_name="router-test")
    router = StickyConversationRouter(deployment, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    replicas = []
    for name, given in stats.items():
        replica = Candidate(ReplicaID(name, deployment), {"prefill_tokens_per_s": 1000.0, "mean_prefill_tokens": 100.0,
                                                          **given}, max_ongoing_requests)
        router.on_new_queue_len_info(replica.replica_id, int(given.get("running_requests", 0)))
        replicas.append(replica)
    return router, replicas


def _names(ranks) -> list[str]:
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


def _decisions(reason: str) -> float:
    return ROUTING_REGISTRY.get_sample_value("hybridserve_route_decisions_total", {"reason": reason})


async def _first(router, replicas, request) -> str:
    return _names(await router.choose_replicas(replicas, request))[0]


@pytest.mark.parametrize("queued, expected", [(400, "a"), (600, "b")])
async def test_a_holder_is_worth_waiting_for_exactly_while_its_saved_prefill_exceeds_its_extra_queue(queued, expected):
    """a holds 500 tokens of the prompt with `queued` prompt tokens ahead; b is idle and holds
    nothing. At equal speeds a wins while 500 > queued."""
    reason = "prefix_holder" if expected == "a" else "prefix_holder_busy"
    before = _decisions(reason)
    router, replicas = _router(a={"running_requests": 1, "waiting_prefill_tokens": queued}, b={})
    assert await _first(router, replicas, _job_request(1, holders=(("a", 500),))) == expected
    assert _decisions(reason) == before + 1


async def test_a_report_older_than_the_requests_it_counts_does_not_price_their_prompts():
    """a's last report was taken while the request that left its 44-token prefix still prefilled
    (one running, 45 tokens waiting); that request has ended since (Serve counts nothing in flight
    on a). Its own prompt is no queue: the repeat of it goes to a, which holds 44 of its 45."""
    router, replicas = _router(a={"running_requests": 1, "waiting_prefill_tokens": 45}, b={})
    router.on_new_queue_len_info(replicas[0].replica_id, 0)
    assert await _first(router, replicas, _job_request(1, holders=(("a", 44),))) == "a"


async def test_each_replica_is_priced_at_its_own_measured_speed():
    """A slow holder (100 tokens/s) with 100 tokens queued (1 s) loses to a fast replica
    recomputing the 500-token prefix (0.5 s); with nothing queued it wins (0 s)."""
    slow = {"prefill_tokens_per_s": 100.0}
    router, replicas = _router(a={**slow, "running_requests": 1, "waiting_prefill_tokens": 100}, b={})
    assert await _first(router, replicas, _job_request(1, holders=(("a", 500),))) == "b"
    router, replicas = _router(a=slow, b={})
    assert await _first(router, replicas, _job_request(2, holders=(("a", 500),))) == "a"


@pytest.mark.parametrize("import_speed, expected, reason", [
    (20000.0, "b", "prefix_import"),  # 2,000 tokens in 0.1 s: cheaper than a's 1 s queue
    (1500.0, "a", "prefix_holder"),   # 1.33 s: waiting for a is cheaper
])
async def test_an_idle_replica_imports_a_busy_holders_prefix_from_the_tier_exactly_when_cheaper(
        import_speed, expected, reason):
    """a holds a 2,000-token prefix behind 1,000 queued prompt tokens (1 s at 1,000 tokens/s); b
    is idle and holds nothing, but the tier holds the prefix: b costs its import at b's measured
    import speed. Recomputing it (2 s) never wins."""
    before = _decisions(reason)
    router, replicas = _router(a={"running_requests": 1, "waiting_prefill_tokens": 1000},
                               b={"import_tokens_per_s": import_speed})
    request = _job_request(1, holders=(("a", 2000),), tier=("name", 2000))
    assert await _first(router, replicas, request) == expected
    assert _decisions(reason) == before + 1


async def test_a_prefix_only_the_tier_holds_goes_to_the_replica_importing_it_soonest():
    """Nobody holds it: the tier does. Without it both replicas would recompute (least loaded)."""
    router, replicas = _router(a={"import_tokens_per_s": 5000.0}, b={"import_tokens_per_s": 50000.0})
    before = _decisions("prefix_import")
    assert await _first(router, replicas, _job_request(1, tier=("name", 3000))) == "b"
    assert _decisions("prefix_import") == before + 1


async def test_the_longer_held_prefix_wins_at_equal_queues():
    router, replicas = _router(a={}, b={}, c={})
    before = _decisions("prefix_holder")
    # "gone" (a replica that died holding more) is no candidate: b holds the longest prefix there is
    ranks = await router.choose_replicas(replicas, _job_request(1, holders=(("c", 300), ("b", 800), ("gone", 900))))
    assert _names(ranks) == ["b", "c", "a"]
    assert _decisions("prefix_holder") == before + 1


async def test_requests_sent_since_the_last_report_count_as_queue():
    """One hot prefix, requests arriving together (no new report between them): the holder
    takes them while its added queue (a mean prompt each) costs less than recomputing the
    prefix elsewhere, then the other replica does (and holds the prefix from then on)."""
    router, replicas = _router(a={}, b={})
    firsts = [await _first(router, replicas, _job_request(n, holders=(("a", 250),))) for n in range(4)]
    assert firsts == ["a", "a", "a", "b"]  # a's queue: 0, 100, 200 tokens < 250; then 300 > 250


def _burst(first: int, n: int) -> list[PendingRequest]:
    """Loops of different tenants starting together: 2,000-token prompts sharing nothing."""
    return [_job_request(k, names=((f"task-{k}", 2000),)) for k in range(first, first + n)]


async def test_a_stale_report_hides_none_of_the_requests_sent_since():
    """a's last report still counts 5 requests that have ended (Serve counts none in flight on it)
    when 8 loops arrive together. Each is priced at its own prompt where it goes: they split 4/4.
    (Counted only beyond the report's 5, the first sends to a cost nothing: bench.agent saw 7 of 8
    loops go to one replica of two.)"""
    router, replicas = _router(a={"running_requests": 5}, b={})
    router.on_new_queue_len_info(replicas[0].replica_id, 0)
    firsts = [await _first(router, replicas, request) for request in _burst(0, 8)]
    assert Counter(firsts) == {"a": 4, "b": 4}, firsts


async def test_a_replicas_past_prompts_do_not_price_a_new_burst():
    """a served long prompts before (mean prefill 2,000 tokens), b short ones (100). A burst of
    2,000-token prompts costs each replica the same per request: they split 4/4 (priced at each
    replica's mean, b took 20 before a took one)."""
    router, replicas = _router(a={"mean_prefill_tokens": 2000.0}, b={"mean_prefill_tokens": 100.0})
    firsts = [await _first(router, replicas, request) for request in _burst(0, 8)]
    assert Counter(firsts) == {"a": 4, "b": 4}, firsts


async def test_requests_a_report_covers_are_not_counted_again():
    """Two 2,000-token requests were sent to a; a's next report (taken after they were sent) has
    them prefilled (nothing waiting). b reports 500 tokens waiting. The next request goes to a:
    its sends are in its report now, not queue on top of it."""
    router, replicas = _router(a={}, b={})
    a, b = replicas
    for request in _burst(0, 2):
        await router.choose_replicas([a], request)
        router.on_send_request(a.replica_id)
    a.routing_stats |= {"running_requests": 2, "waiting_prefill_tokens": 0, "reported_at": time.time() + 1e-3}
    b.routing_stats |= {"running_requests": 1, "waiting_prefill_tokens": 500}
    router.on_new_queue_len_info(a.replica_id, 2)
    router.on_new_queue_len_info(b.replica_id, 1)
    assert await _first(router, replicas, _burst(2, 1)[0]) == "a"


async def test_a_busy_owner_keeps_its_turn_unless_the_tier_holds_the_head():
    """The owner a has 5,000 tokens queued (5 s). Without a tier copy the turn waits for it (a
    move would recompute the history); with one, b imports the 1,000-token head (at a measured
    10,000 tokens/s: 0.1 s) and takes the turn."""
    busy = {"running_requests": 4, "waiting_prefill_tokens": 5000}
    router, replicas = _router(a=busy, b={"import_tokens_per_s": 10_000.0})
    before = _decisions("owner_busy_moved")
    assert await _first(router, replicas, _job_request(1, owner="a")) == "a"
    assert await _first(router, replicas, _job_request(2, owner="a", tier_copy=True)) == "b"
    assert _decisions("owner_busy_moved") == before + 1
    router, replicas = _router(a={"running_requests": 1, "waiting_prefill_tokens": 50}, b={})
    assert await _first(router, replicas, _job_request(3, owner="a", tier_copy=True)) == "a"  # 0.05 s < 0.1 s


@pytest.mark.parametrize("tier, reason", [(None, "prefix_holder_busy"), (("name", 2000), "prefix_import")])
async def test_a_full_holder_ranks_after_a_replica_with_room_and_the_reason_says_where_the_request_went(
        tier, reason):
    """a holds the request's 2,000-token prefix with nothing queued, but runs its
    max_ongoing_requests (8, by Serve's count): Serve would skip it, so b, which has room, is the
    first rank, and the decision counted is b's: it computes the prefix, or imports it where the
    tier holds it. Before, a ranked first and `prefix_holder` was counted for a request b served."""
    router, replicas = _router(8, a={"running_requests": 8}, b={})
    before = _decisions(reason)
    request = _job_request(1, holders=(("a", 2000),), tier=tier)
    assert _names(await router.choose_replicas(replicas, request)) == ["b", "a"]
    assert _decisions(reason) == before + 1
    router.on_new_queue_len_info(replicas[0].replica_id, 7)  # a has room again: the holder wins
    assert await _first(router, replicas, _job_request(2, holders=(("a", 2000),), tier=tier)) == "a"


async def test_a_full_owner_is_left_as_a_busy_one_and_all_full_keeps_the_order():
    router, replicas = _router(8, a={"running_requests": 8}, b={})
    before = _decisions("owner_busy_moved")
    assert await _first(router, replicas, _job_request(1, owner="a")) == "b"  # no tier copy: recomputed there
    assert _decisions("owner_busy_moved") == before + 1
    router.on_new_queue_len_info(replicas[1].replica_id, 8)  # both full: Serve backs off, the owner stays first
    assert await _first(router, replicas, _job_request(2, owner="a")) == "a"


async def test_the_owner_wins_over_prefix_holders_and_when_gone_the_holders_count_for_nothing():
    router, replicas = _router(a={}, b={"running_requests": 5, "waiting_prefill_tokens": 500}, c={})
    ranks = await router.choose_replicas(replicas, _job_request(1, owner="b", holders=(("c", 900),)))
    assert _names(ranks)[0] == "b"  # holders only matter without a head
    before = _decisions("owner_gone")
    ranks = await router.choose_replicas([replicas[0], replicas[2]], _job_request(2, owner="b"))
    assert _decisions("owner_gone") == before + 1 and len(ranks) == 2


async def test_requests_arriving_together_over_a_prefix_nobody_holds_go_where_the_first_computes_it():
    """Four loops of one tenant start together over a 2,000-token catalogue (the first message's
    name) with their own tasks: nobody holds anything, so the first goes by load and the others
    follow it (the engine attaches its mark) while that saves more than the queue it adds. A
    prefix under 32 tokens is not worth it: those spread by load."""
    router, replicas = _router(a={}, b={})
    before = _decisions("prefix_computing")
    loops = [_job_request(n, names=(("catalogue", 2000), (f"task-{n}", 2050))) for n in range(4)]
    firsts = [await _first(router, replicas, request) for request in loops]
    assert len(set(firsts)) == 1, firsts
    assert _decisions("prefix_computing") == before + 3
    router, replicas = _router(a={}, b={})
    short = [_job_request(10 + n, names=(("hello", 20), (f"task-{n}", 60))) for n in range(2)]
    assert {await _first(router, replicas, request) for request in short} == {"a", "b"}


async def test_a_large_fleet_is_priced_on_a_shortlist_that_keeps_every_replica_the_request_names():
    """Beyond PRICE_ALL candidates only the least loaded by requests and the replicas the request
    names are priced (the cost per decision grew with the fleet: bench/results/scale.md). A busy
    holder of a long prefix is still weighed and wins while its saved prefill exceeds its queue;
    the owner of a conversation keeps its turn however many requests it runs; every candidate is
    still in the ranks, once, the priced ones first."""
    from deployments.routing.router import PRICE_ALL, PRICED_LEAST_LOADED

    n = PRICE_ALL * 3
    busy = {"running_requests": 40, "waiting_prefill_tokens": 300}
    stats = {f"r{i:03d}": {"running_requests": i % 7, "waiting_prefill_tokens": 100 * (i % 7)} for i in range(n - 1)}
    router, replicas = _router(**stats, holder=busy)
    ranks = _names(await router.choose_replicas(replicas, _job_request(1, holders=(("holder", 2000),))))
    assert ranks[0] == "holder"  # 2,000 tokens saved against 300 queued: worth waiting for
    assert sorted(ranks) == sorted([*stats, "holder"])
    idle = [name for name, given in stats.items() if given["running_requests"] == 0]
    assert set(ranks[1:PRICED_LEAST_LOADED + 1]) <= set(idle) | {"r000"}  # the least loaded come next
    owner_ranks = _names(await router.choose_replicas(replicas, _job_request(2, owner="holder")))
    assert owner_ranks[0] == "holder"  # no tier copy: the turn waits for its owner
    moved = _names(await router.choose_replicas(replicas, _job_request(3, owner="holder", tier_copy=True,
                                                                      head_tokens=100)))
    assert moved[0] in idle  # a cheap import beats the owner's queue of 40 requests
