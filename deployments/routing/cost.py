"""Where a request is served soonest: each candidate replica's expected time to first token.

    expected_ttft(r) = (ahead(r) + lacking(r)) / prefill_speed(r)          [+ import(r) for a head]

    ahead(r)    prefill tokens queued on r before this request: the waiting prompt tokens r last
                reported (of its requests still live), plus the estimated prefill of each request
                this router sent to r since that report (sent_log.py: its prompt less what r held
                or was computing of it; r's mean prefill where the router could not tell)
    lacking(r)  the tokens of this request r must compute that the best-placed replica would not:
                a stateless request or a first turn -> longest held prefix - the prefix r holds
                                                       (a stateless chat: or, where the state tier
                                                       holds a longer one than r, its import at
                                                       r's import speed plus the rest, if cheaper);
                a conversation's turn               -> 0 on its owner; elsewhere the import of
                                                       its head from the tier, or, without a tier
                                                       copy, its recompute from the ledger (then
                                                       only when the owner is gone: see `rank`)
    speeds      measured by each replica (prefill tokens/s of its engine steps, head tokens/s of
                its tier imports) and reported with its routing stats; a replica that has not
                measured yet is taken to run at the fleet's median

A replica at its max_ongoing_requests (by Serve's count, which Serve skips it by) is ranked after
every replica with room, so the first rank is where the request goes and its reason says why:
a conversation's full owner is left as a busy one is (`owner_busy_moved`), a full holder as a busy
one (`prefix_holder_busy`, or `prefix_import` where another replica imports the prefix instead).

A replica computing the request's prefix for an earlier arrival (coalescing) has that prefix in
its queue; it is also what the request lacks anywhere else, so it is counted once: only its queue
beyond the prefix is extra there.

The part of the prompt nobody holds (a turn's new messages) costs every replica the same and is
left out: it cannot change which one is cheapest at equal speeds, and the router does not
tokenize. So a holder is worth waiting for exactly while the prefill it saves exceeds its extra
queue; past that the request goes elsewhere and computes the prefix once, and from then on that
replica holds it too.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import median

# Until a replica has measured its speeds (no prefill yet): an order of magnitude of a small
# model on two CPU cores. Only ratios between replicas matter while all of them use it.
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
# A tier import moves bytes, not FLOPs: taken as this many times faster than prefill until measured.
DEFAULT_IMPORT_SPEEDUP = 10.0
DEFAULT_MEAN_PREFILL_TOKENS = 256.0  # until measured


class RouteReason(enum.Enum):
    """Why a request went where it went (`hybridserve_route_decisions_total{reason}`)."""

    OWNER = "owner"  # a conversation's turn on the replica holding its head
    OWNER_BUSY_MOVED = "owner_busy_moved"  # the owner's queue cost more than moving the head
    OWNER_GONE = "owner_gone"  # the owner is no longer a candidate: the head moves
    PREFIX_HOLDER = "prefix_holder"  # a replica holding the request's longest known prefix
    PREFIX_HOLDER_BUSY = "prefix_holder_busy"  # holders' queues cost more than recomputing it
    # nobody holds its prefix yet; an earlier request sharing it was sent here and computes it
    # (the engine lets this one attach it as soon as that one's prefill passed it)
    PREFIX_COMPUTING = "prefix_computing"
    # the state tier holds more of its prefix than this replica, and importing it here is cheaper
    # than any holder's queue or computing it (worker/prefix_tier.py imports it)
    PREFIX_IMPORT = "prefix_import"
    LEAST_LOADED = "least_loaded"  # nobody holds anything of it: the shortest queue


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one candidate's queue and speeds."""

    reported_requests: int = 0  # requests in its engine at its last report
    waiting_prefill_tokens: int = 0  # prompt tokens not yet computed, of the reported requests still live
    sent_since_report: int = 0  # requests routed to it since its report, still live
    prefill_tokens_per_s: float = 0.0  # 0: not measured yet
    import_tokens_per_s: float = 0.0  # head tokens imported from the tier per second; 0: not measured
    mean_prefill_tokens: float = 0.0  # 0: not measured yet
    # the estimated prefill of each of those sent (None: unknown, priced at the mean); empty: a
    # mean prefill for each of `sent_since_report`
    sent_prefill_tokens: tuple[float | None, ...] = ()
    full: bool = False  # at its max_ongoing_requests: Serve sends the request to a later rank

    @classmethod
    def of(cls, stats: Mapping, live_requests: int | None, sent: Sequence[float | None] = (),
           max_ongoing_requests: int = 0) -> "ReplicaLoad":
        """From a replica's routing stats (Worker.record_routing_stats), the requests Serve and
        this router count against it now (None: Serve's count is stale, the report stands), what
        this router sent it since that report (SentLog.since: estimated prefill each), and the
        requests it takes at once (0: no limit known)."""
        full = live_requests is not None and 0 < max_ongoing_requests <= live_requests
        reported = int(stats.get("running_requests", 0))
        waiting = int(stats.get("waiting_prefill_tokens", 0))
        sent = tuple(sent)
        if live_requests is not None:
            # Requests end roughly in the order they came: the newest sends are the ones still live.
            sent = sent[max(0, len(sent) - live_requests):]
            old = min(reported, max(0, live_requests - len(sent)))
            if old < reported:
                # Requests of the report finished since (Serve's count drops as each one ends):
                # their unprefilled prompts went with them. Left in, the report taken while a
                # request prefilled makes its own replica look busy by its prompt right after it
                # ended, and a repeat of that prompt (which saves one token less) goes elsewhere.
                waiting = waiting * old // reported
        return cls(reported, waiting, len(sent),
                   float(stats.get("prefill_tokens_per_s", 0.0)), float(stats.get("import_tokens_per_s", 0.0)),
                   float(stats.get("mean_prefill_tokens", 0.0)), sent, full)


@dataclass(frozen=True)
class Need:
    """What one request needs of a replica, as far as the router can tell."""

    held: Mapping[str, int]  # replica -> prompt tokens it holds (its prefix, or the owner's head)
    owner: str = ""  # a conversation's owner ("" for stateless requests and first turns)
    head_tokens: int = 0  # a conversation's committed tokens (what a non-owner lacks)
    tier_has_head: bool = False  # the tier holds the current head: a non-owner imports it
    computing: frozenset[str] = frozenset()  # replicas in `held` only for computing it now (estimated tokens)
    tier_tokens: int = 0  # the longest prefix of a stateless request the state tier holds (any replica imports it)
    # the request's own prompt (a conversation's turn: its new messages), estimated; 0: unknown
    prompt_tokens: int = 0


def prefill_estimate(replica: str, need: Need) -> float | None:
    """The tokens this request will compute on `replica` (None: the router cannot tell): what the
    sent log counts against that replica until its next report."""
    if not need.prompt_tokens:
        return None
    if need.owner:  # the new messages, and the head where it must be recomputed
        moved = replica != need.owner and not need.tier_has_head
        return need.prompt_tokens + (need.head_tokens if moved else 0)
    own = max(need.held.get(replica, 0), need.tier_tokens)
    return max(0, need.prompt_tokens - own)


@dataclass(frozen=True)
class Choice:
    replica: str
    expected_ttft_s: float
    reason: RouteReason


class Speeds:
    """Each replica's measured speeds, with the fleet's median standing in for one not measured."""

    def __init__(self, loads: Mapping[str, ReplicaLoad]):
        prefill = [x.prefill_tokens_per_s for x in loads.values() if x.prefill_tokens_per_s > 0]
        imports = [x.import_tokens_per_s for x in loads.values() if x.import_tokens_per_s > 0]
        prompts = [x.mean_prefill_tokens for x in loads.values() if x.mean_prefill_tokens > 0]
        self._prefill = median(prefill) if prefill else DEFAULT_PREFILL_TOKENS_PER_S
        self._import = median(imports) if imports else self._prefill * DEFAULT_IMPORT_SPEEDUP
        self._prompt = median(prompts) if prompts else DEFAULT_MEAN_PREFILL_TOKENS
        self._loads = loads

    def prefill(self, replica: str) -> float:
        return self._loads[replica].prefill_tokens_per_s or self._prefill

    def imports(self, replica: str) -> float:
        return self._loads[replica].import_tokens_per_s or self._import

    def queue_s(self, replica: str) -> float:
        load = self._loads[replica]
        mean = load.mean_prefill_tokens or self._prompt
        if load.sent_prefill_tokens:
            sent = sum(mean if tokens is None else tokens for tokens in load.sent_prefill_tokens)
        else:
            sent = load.sent_since_report * mean
        return (load.waiting_prefill_tokens + sent) / self.prefill(replica)


def expected_ttft(replica: str, need: Need, speeds: Speeds) -> float:
    """This request's time to first token on `replica`, less the part every replica shares."""
    queue = speeds.queue_s(replica)
    if replica in need.computing:
        # The prefix it computes for this request is in its queue and is what this request lacks
        # anywhere else: counted once. Waiting for it costs no more than computing it elsewhere,
        # and the fleet computes it once; only the queue beyond it is extra.
        queue = max(0.0, queue - need.held[replica] / speeds.prefill(replica))
    if need.owner:  # a conversation's turn: the owner has the head, anyone else must get it
        if replica == need.owner:
            return queue
        if need.tier_has_head:
            return queue + need.head_tokens / speeds.imports(replica)
        return queue + need.head_tokens / speeds.prefill(replica)
    return queue + _prefix_lacking_s(replica, need, speeds)[0]


def _prefix_lacking_s(replica: str, need: Need, speeds: Speeds) -> tuple[float, bool]:
    """(seconds to get what `replica` lacks of the longest held prefix, whether by a tier import)."""
    best = max(need.tier_tokens, max(need.held.values(), default=0))
    own = need.held.get(replica, 0)
    compute = (best - own) / speeds.prefill(replica)
    if need.tier_tokens <= own:
        return compute, False
    imported = need.tier_tokens / speeds.imports(replica) + (best - need.tier_tokens) / speeds.prefill(replica)
    return (imported, True) if imported < compute else (compute, False)


def rank(candidates: Sequence[str], loads: Mapping[str, ReplicaLoad], need: Need) -> list[Choice]:
    """Candidates cheapest first (ties keep the given order: the caller shuffles equals), each
    with the reason the first one won. An empty list for no candidates."""
    # A holder that is no candidate (gone, or not of this deployment) saves nobody anything.
    need = replace(need, held={r: tokens for r, tokens in need.held.items() if r in candidates})
    speeds = Speeds(loads)
    full = {r for r in candidates if loads[r].full}
    if len(full) == len(candidates):  # all full: Serve backs off and asks again; the order stands
        full = set()
    costs = sorted(((math.inf if r in full else expected_ttft(r, need, speeds), i, r)
                    for i, r in enumerate(candidates)))
    if not costs:
        return []
    if need.owner in candidates and not need.tier_has_head and need.owner not in full:
        # Without a tier copy a move recomputes the whole history from the ledger and leaves the
        # owner's copy stale: the turn waits for its owner (unless it is full: Serve skips it).
        costs.sort(key=lambda c: c[2] != need.owner)
    first = costs[0][2]
    reason = _reason(first, candidates, need)
    if not need.owner and _prefix_lacking_s(first, need, speeds)[1]:
        reason = RouteReason.PREFIX_IMPORT
    return [Choice(r, cost, reason) for cost, _, r in costs]


def _reason(first: str, candidates: Sequence[str], need: Need) -> RouteReason:
    if need.owner:
        if first == need.owner:
            return RouteReason.OWNER
        return RouteReason.OWNER_BUSY_MOVED if need.owner in candidates else RouteReason.OWNER_GONE
    holders = [r for r in candidates if need.held.get(r, 0) > 0]
    if not holders:
        return RouteReason.LEAST_LOADED
    if need.held.get(first, 0) != max(need.held.values()):
        return RouteReason.PREFIX_HOLDER_BUSY
    return RouteReason.PREFIX_COMPUTING if first in need.computing else RouteReason.PREFIX_HOLDER
