"""The serving metrics under vLLM's names (`vllm:*`, labelled `model_name`), beside ours, so what
reads a vLLM server reads us unchanged: the Gateway API inference extension's endpoint picker
(queued and running requests, KV cache utilization), KEDA scalers, vLLM's Grafana dashboards.

What each means here, measured at the ingress (vLLM measures in its engine):

    vllm:num_requests_waiting     admitted, no token yet (waiting for a worker, a lease, a busy
                                  conversation, or in prefill)
    vllm:num_requests_running     streaming tokens
    vllm:kv_cache_usage_perc      the mean over worker replicas of the fraction of KV blocks held
                                  by running requests (0..1; blocks only cached state holds are
                                  evictable, as vLLM's cached blocks); from the replicas' routing
                                  stats, at most request_routing_stats_period_s old
    vllm:prefix_cache_queries     prompt tokens of finished requests; hits: those served from
                                  cached state (a conversation's head, a prefix, a system prompt)
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:time_per_output_token_seconds (per request: after the first token, per token),
    vllm:e2e_request_latency_seconds, vllm:prompt_tokens, vllm:generation_tokens,
    vllm:request_success{finished_reason}
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deployments.messages import TurnDone

# vLLM's own buckets for these histograms (vllm/v1/metrics/loggers.py)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


class VllmNamedMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=registry).labels(model_name)

        self.waiting = gauge("vllm:num_requests_waiting", "requests admitted that have no token yet")
        self.running = gauge("vllm:num_requests_running", "requests streaming tokens")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "fraction of KV cache blocks in use (0..1), mean "
                                                                "over worker replicas")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "prompt tokens looked up in the caches")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "prompt tokens served from cached state")
        self.prompt_tokens = counter("vllm:prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "generated tokens")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "arrival to first token", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "between tokens", _TOKEN_GAP_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "per request: time after the first token per "
                                                                    "later token", _TOKEN_GAP_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "arrival to the last token", _REQUEST_BUCKETS)
        self._success = Counter("vllm:request_success", "finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=registry)
        self._model_name = model_name

    def finished(self, done: TurnDone, *, arrived: float, first_token: float | None, now: float) -> None:
        """A request that ran to its end (not one answered from the ledger: it counted when it ran)."""
        self.prompt_tokens.inc(done.prompt_tokens)
        self.prefix_queries.inc(done.prompt_tokens)
        self.prefix_hits.inc(done.cached_tokens)
        self.e2e.observe(now - arrived)
        if first_token is not None and done.completion_tokens > 1:
            self.tpot.observe((now - first_token) / (done.completion_tokens - 1))
        self._success.labels(self._model_name, done.finish_reason).inc()
