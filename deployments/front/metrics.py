"""Prometheus metrics of the ingress (`GET /metrics`), in a registry of their own: ours
(`hybridserve_*`) and the same measurements under vLLM's names (vllm_metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deployments.front.vllm_metrics import VllmNamedMetrics
from deployments.messages import Recovery
from deployments.turn.lease_keeper import Renewal
from deployments.routing.decisions import ROUTING_REGISTRY

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# TTFT's `turn` label: the turn of a conversation, in doubling ranges (a bounded set of series
# however long conversations grow), or "stateless" for requests without a conversation.
TURN_RANGES = ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16"), (32, "17-32"))
LONGER = "33+"
STATELESS = "stateless"


def turn_range(turn: int | None) -> str:
    """The `turn` label of a conversation's turn (1-based), or of a stateless request (None)."""
    if turn is None:
        return STATELESS
    return next((name for last, name in TURN_RANGES if turn <= last), LONGER)


class ServeMetrics:
    def __init__(self, model_name: str) -> None:
        r = self.registry = CollectorRegistry()
        self.vllm = VllmNamedMetrics(r, model_name)
        self._worst_renewal_delay = 0.0
        self.ttft = Histogram("hybridserve_time_to_first_token_seconds", "request arrival to first token, by the "
                              "conversation's turn (ranges: 1, 2, 3-4, ..., 33+) or stateless: with its head reused, "
                              "a later turn's TTFT stays flat", ["turn"], buckets=_LATENCY_BUCKETS, registry=r)
        for name in [name for _, name in TURN_RANGES] + [LONGER, STATELESS]:
            self.ttft.labels(name)  # exported from the start
        self.itl = Histogram("hybridserve_inter_token_latency_seconds", "between streamed token deltas",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.output_tokens = Counter("hybridserve_output_tokens", "generated tokens (rate() = tokens/s)", registry=r)
        self.prompt_tokens = Counter("hybridserve_prompt_tokens", "prompt tokens", registry=r)
        self.cache_hits = Counter("hybridserve_cache_hits", "continued turns that reused a committed head", registry=r)
        self.cache_misses = Counter("hybridserve_cache_misses", "continued turns that recomputed", registry=r)
        self.tokens_reused = Counter("hybridserve_cached_tokens", "prompt tokens reused from heads", registry=r)
        self.tokens_reused_by_source = Counter(
            "hybridserve_cached_tokens_by_source", "prompt tokens reused, by where the state came from: head (the "
            "conversation's), prefix (a message boundary or an earlier request's end), system (a shared system "
            "prompt)", ["source"], registry=r)
        self.prefix_lookups = Counter(
            "hybridserve_prefix_lookups", "requests without a conversation head (stateless, first turns, misses) by "
            "whether a held prefix served them", ["result"], registry=r)
        for result in ("hit", "miss"):
            self.prefix_lookups.labels(result)  # exported from the start (rate() needs the zero)
        self.prefix_index_names = Gauge(
            "hybridserve_prefix_index_names", "message prefixes the cache service's prefix index names (read at "
            "each scrape)", registry=r)
        self.tool_call_replies = Counter(
            "hybridserve_tool_call_replies", "replies that ended in tool calls (their state then waits for the "
            "tools' results, evicted last for tool_pause_s)", registry=r)
        self.tool_resumes = Counter(
            "hybridserve_tool_resumes", "requests bringing tool results (last message role tool), by whether "
            "cached state served them", ["result"], registry=r)
        for result in ("hit", "miss"):
            self.tool_resumes.labels(result)
        self.migrations = Counter("hybridserve_migrations", "turns served away from the head's owner", registry=r)
        self.tier_imports = Counter("hybridserve_tier_imports", "heads imported from the state tier", registry=r)
        self.tier_prefix_imports = Counter(
            "hybridserve_tier_prefix_imports", "older heads imported from the state tier (the turns after them "
            "recomputed)", registry=r)
        self.prefix_imports = Counter(
            "hybridserve_prefix_imports", "stateless requests whose prefix checkpoint was imported from the state "
            "tier (computed on another replica) instead of computed", registry=r)
        self.ledger_recomputes = Counter(
            "hybridserve_ledger_recomputes", "heads rebuilt from the ledger (after any earlier head the replica "
            "still held)", registry=r)
        self.lease_conflicts = Counter("hybridserve_lease_conflicts", "turns refused: conversation busy", registry=r)
        self.requests = Counter("hybridserve_requests", "chat completion requests by status", ["status"], registry=r)
        self.queue_depth = Gauge("hybridserve_inflight_requests", "chat completions in flight at the ingress",
                                 registry=r)
        self.lease_renewal_delay_max = Gauge(
            "hybridserve_lease_renewal_delay_max_seconds", "the latest any lease renewal ran past its time",
            registry=r)
        self.lease_renewal_seconds = Histogram(
            "hybridserve_lease_renewal_rpc_seconds", "how long each RenewLease call took, by outcome: renewed, "
            "failed (no verdict; the next renewal retries), lost (the service says the lease is gone)",
            ["outcome"], buckets=_LATENCY_BUCKETS, registry=r)

    def turn_done(self, *, continued: bool, cached_tokens: int, recovery: Recovery, moved: bool,
                  reused_from: str = "", tool_resume: bool = False, tool_calls: int = 0) -> None:
        if tool_resume:
            self.tool_resumes.labels("hit" if cached_tokens > 0 else "miss").inc()
        if tool_calls:
            self.tool_call_replies.inc()
        if continued:
            (self.cache_hits if cached_tokens > 0 else self.cache_misses).inc()
        if reused_from != "head":
            self.prefix_lookups.labels("hit" if reused_from else "miss").inc()
        self.tokens_reused.inc(cached_tokens)
        if reused_from:
            self.tokens_reused_by_source.labels(reused_from).inc(cached_tokens)
        if recovery is Recovery.TIER_IMPORT:
            self.tier_imports.inc()
        elif recovery is Recovery.TIER_PREFIX:
            self.tier_prefix_imports.inc()
        elif recovery is Recovery.PREFIX_IMPORT:
            self.prefix_imports.inc()
        elif recovery is Recovery.LEDGER_RECOMPUTE:
            self.ledger_recomputes.inc()
        if moved:
            self.migrations.inc()

    def render(self) -> bytes:
        # The router's decisions are counted where it runs: in this process, in its own registry.
        return generate_latest(self.registry) + generate_latest(ROUTING_REGISTRY)

    def lease_renewal_rpc(self, seconds: float, outcome: Renewal) -> None:
        """Called from the lease keeper's thread, as below."""
        self.lease_renewal_seconds.labels(outcome.value).observe(seconds)

    def lease_renewal_delay(self, seconds: float) -> None:
        """Called from the lease keeper's thread (prometheus_client's metrics are thread-safe)."""
        if seconds > self._worst_renewal_delay:
            self._worst_renewal_delay = seconds
            self.lease_renewal_delay_max.set(seconds)
