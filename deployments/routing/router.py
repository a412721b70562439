"""Sticky conversation routing on Ray Serve's own extension point: a custom `RequestRouter`.

The ingress sends each turn as a `TurnJob` whose `owner` is the replica the cache service
names as the holder of the conversation's head. Serve calls `choose_replicas` with the live
replicas and tries the returned ranks in order, probing queue lengths; a rank whose replicas
are all full (`max_ongoing_requests`) is skipped:

    [[cheapest], [next cheapest], ...]   by expected time to first token (cost.py): its queue
                                         plus the prefill (or head import) it needs
    a conversation's owner without a tier copy of its head goes first whatever its queue (a move
    would recompute the history); with a tier copy it competes: the head moves when that is cheaper;
    a replica at max_ongoing_requests by Serve's count goes after those with room (Serve would
    skip it): the first rank is where the request goes, and its counted reason says why

Prefix holders: for a stateless request or a new conversation the ingress asks the cache
service's prefix index which replicas hold a prefix of its messages (a shared system prompt,
the history of a stateless chat resent in full) and how many tokens each, its longest:
`TurnJob.prefix_holders` (a holder that is no longer a candidate counts for nothing). There the
prompt's start is a local hit; elsewhere it is recomputed once, and then held there too. A
holder is preferred exactly while the prefill it saves outweighs its longer queue. Where the state
tier holds a prefix too (`TurnJob.tier_prefix`), a replica lacking it may import it instead of
computing it (worker/prefix_tier.py): priced at its measured import speed (cost.py).

Requests arriving together over a prefix nobody holds yet (a tenant's loops starting over one tool
catalogue) are coalesced: the first goes by load and its message prefixes of >= 32 (estimated)
tokens are taken as being computed there (COMPUTING_TTL_S); a later one sharing one goes there
while that is cheapest, and the engine attaches the first one's mark as soon as its prefill
passed it (workers/cache/prefix_wait.py) instead of computing the prefix again.

Queue = the worker's routing stats (`record_routing_stats`, every second: requests in its engine,
prompt tokens waiting, measured speeds) plus what this router sent it since that report, each at
its own estimated prefill there (sent_log.py), as many as Serve's live count allows. Equal costs
go to the less loaded replica (fewer requests, then more free blocks, then at random). A replica that
takes a conversation it does not own gets the head by the recovery ladder (tier import, else
ledger recompute); see worker/replica.py.

Simultaneous arrivals: Serve counts a request against its replica only once it was sent
(`on_send_request`), after probing, i.e. after an `await`; two new conversations routed in
that window would both see an idle pool and pick the same replica. So a choice counts from
the moment it is made (SentLog.choose):

    choose_replicas(X) ─ X's first rank gets +1 ─┐   choose_replicas(Y) sees A busier: B
                                                 └─ on_send_request(A): Serve counts X now, -1

`on_send_request(replica)` is the one hook Serve calls for every request sent (with or without
strict max_ongoing_requests; `on_request_routed` only runs on the strict path) and it bumps
Serve's queue-length cache: so the oldest choice of that replica becomes a send (SentLog.on_send).
A choice no request was sent for (cancelled while probing; its request went to a later rank) stops
counting after CHOICE_TTL_S (sent_log.py).

The base router matches a choice to the request it was made for (by internal request id).
Serve's `FIFOMixin` must not be used here: it hands a replica chosen for one conversation to
whichever request is first in the queue, i.e. to another conversation, breaking stickiness.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.messages import ReplicaCall, TurnJob
from deployments.routing import fleet
from deployments.routing.cost import Need, ReplicaLoad, RouteReason, prefill_estimate, rank
from deployments.routing.decisions import count_decision
from deployments.routing.recent_prefixes import RecentPrefixes
from deployments.routing.sent_log import SentLog
from deployments.routing.token_estimate import estimated_tokens
# Coalescing: a prefix nobody held, sent to a replica, is taken as being computed there this long
# (a first request's prefill and reply, under load; its end's announce then names the holder).
COMPUTING_TTL_S = 60.0
# Shorter shared prefixes are recomputed rather than coalesced: the engine's MIN_SHARED_TOKENS
# (workers/cache/prefix_wait.py, not imported: the ingress loads no torch).
COALESCE_MIN_TOKENS = 32
# Beyond this many candidates a request is priced on a shortlist (StickyConversationRouter._shortlist):
# the replicas it names and this many of the least loaded by requests.
PRICE_ALL = 64
PRICED_LEAST_LOADED = 16


def requested_call(pending_request: PendingRequest | None) -> TurnJob | ReplicaCall | None:
    """The request's turn or replica call (None: a call with no preference, e.g. a health check:
    the least loaded replica takes it)."""
    if pending_request is None:
        return None
    for arg in [*pending_request.args, *pending_request.kwargs.values()]:
        if isinstance(arg, (TurnJob, ReplicaCall)):
            return arg
    return None


def need_of(call: TurnJob | ReplicaCall, computing: RecentPrefixes | None = None) -> Need:
    if isinstance(call, ReplicaCall):
        return Need({}, owner=call.owner)
    head = call.head
    if head is None:  # stateless, or a conversation's first turn: where its prefix is held
        held = dict(call.prefix_holders)
        tier = call.tier_prefix[1] if call.tier_prefix is not None else 0
        prompt = call.prefix_names[-1][1] if call.prefix_names else 0
        if held or tier or computing is None:  # held somewhere: nothing to coalesce
            return Need(held, tier_tokens=tier, prompt_tokens=prompt)
        # nobody holds any of it: where an earlier request sharing a long prefix computes it
        pending = computing.holders([name for name, _ in call.prefix_names])
        return Need(pending, computing=frozenset(pending), prompt_tokens=prompt)
    prompt = estimated_tokens(call.messages)
    if not head.owner:  # nobody holds the head: any replica imports or recomputes it
        return Need({}, prompt_tokens=prompt + head.committed_tokens)
    return Need({head.owner: head.committed_tokens}, owner=head.owner, head_tokens=head.committed_tokens,
                tier_has_head=head.tier_version == head.version, prompt_tokens=prompt)


def load_key(queue_len: int | None, chosen: int, stats: dict[str, Any]) -> tuple[int, int, int, float]:
    """Smaller is less loaded: requests sent or chosen, then running requests, then more free
    blocks; a random last element spreads new conversations over equally idle replicas."""
    return ((queue_len or 0) + chosen, int(stats.get("running_requests", 0)), -int(stats.get("free_kv_blocks", 0)),
            random.random())


class StickyConversationRouter(RequestRouter):
    # Serve probes a replica whose queue length its cache no longer holds (an entry lasts 10 s)
    # and tries the next rank if the answer takes longer than this. Its 0.1 s is missed by a busy
    # worker on a loaded machine (the replica's event loop waits for the GIL behind its engine
    # thread), and a conversation's owner skipped so runs the turn on another replica, which
    # imports the head or, with no tier copy yet, recomputes the whole history. A slow answer is
    # not a dead replica: Serve drops those from the candidates.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 2.0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        fleet.register(self)  # /metrics reads the replicas' routing stats through it
        # choices Serve has not counted yet, and what was sent since each replica's report
        self._sent = SentLog()
        # message prefixes nobody held when a request with them was routed: where they are computed
        self._computing = RecentPrefixes(ttl_s=COMPUTING_TTL_S)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        if pending_request is not None:
            # Every candidate is in the ranks below: if all are full, back off before retrying.
            pending_request.routing_context.should_backoff = True
            self._sent.forget_choice(request_id)  # a retry chooses again
        chosen = self._sent.unsent()
        call = requested_call(pending_request)
        need = need_of(call, self._computing) if call is not None else None
        by_load, rest = self._shortlist(candidate_replicas, chosen, need)
        ranks = by_load
        if need is not None and by_load:
            by_name = {r.replica_id.unique_id: r for r in by_load}
            queues = {name: self._load(r, chosen) for name, r in by_name.items()}
            choices = rank(list(by_name), queues, need)
            ranks = [by_name[c.replica] for c in choices]
            if isinstance(call, TurnJob):
                count_decision(choices[0].reason)
                if choices[0].reason is RouteReason.LEAST_LOADED and call.head is None:
                    self._computing.record(choices[0].replica, [
                        (name, tokens) for name, tokens in call.prefix_names if tokens >= COALESCE_MIN_TOKENS])
        if request_id is not None and ranks:
            tokens = prefill_estimate(ranks[0].replica_id.unique_id, need) if need is not None else None
            self._sent.choose(request_id, ranks[0].replica_id, tokens)
        return [[r] for r in ranks] + [[r] for r in rest]

    def _load(self, replica: RunningReplica, chosen: Counter[ReplicaID]) -> ReplicaLoad:
        """Its last report, and what this router sent it since (Serve's count: how many of those
        are still live; None once Serve's count went stale, then the report stands)."""
        stats = replica.routing_stats or {}
        counted = self.replica_queue_len_cache.get(replica.replica_id)
        live = None if counted is None else counted + chosen[replica.replica_id]
        return ReplicaLoad.of(stats, live, self._sent.since(replica.replica_id, float(stats.get("reported_at", 0.0))),
                              replica.max_ongoing_requests)

    def _shortlist(self, candidates: list[RunningReplica], chosen: Counter[ReplicaID],
                   need: Need | None) -> tuple[list[RunningReplica], list[RunningReplica]]:
        """(the candidates to price, least loaded first; the others, least loaded first). Up to
        PRICE_ALL candidates all are priced; beyond, the PRICED_LEAST_LOADED with the fewest
        requests plus every replica the request names (owner, prefix holders, where its prefix
        is computed): pricing is per replica and per request, and at a thousand replicas it cost
        ~17 ms a decision (bench/results/scale.md) while the rest can only lose (they hold
        nothing of it and have queues at least as long by request count)."""
        cache = self.replica_queue_len_cache
        if len(candidates) <= PRICE_ALL:
            loads = {r.replica_id: load_key(cache.get(r.replica_id), chosen[r.replica_id], r.routing_stats)
                     for r in candidates}
            return sorted(candidates, key=lambda r: loads[r.replica_id]), []
        ids = [r.replica_id for r in candidates]
        sent = [(cache.get(rid) or 0) + chosen[rid] for rid in ids]
        named = set(need.held) | {need.owner} if need is not None else set()
        order = sorted(range(len(candidates)), key=sent.__getitem__)
        priced = set(order[:PRICED_LEAST_LOADED]) | {i for i, rid in enumerate(ids) if rid.unique_id in named}
        loads = {i: load_key(sent[i], 0, candidates[i].routing_stats) for i in priced}
        shortlist = [candidates[i] for i in sorted(priced, key=loads.__getitem__)]
        return shortlist, [candidates[i] for i in order if i not in priced]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._sent.forget_replicas({r.replica_id for r in replicas})

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)  # Serve's queue-length cache counts the request from now
        self._sent.on_send(replica_id)
