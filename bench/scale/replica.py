"""A simulated worker replica: no model, the cache-service cycle of a real one.

Per turn, on one of its BATCH slots (a turn waits for a free slot):

    sleep the turn's time (cost_model.py) (the driver, as the ingress, renews the lease meanwhile)
    publish the head + ledger entry, releasing the lease, owner = this replica
                                            -> PublishTurn
    after the slot is free, where the mix says the conversation goes quiet: export the head
                                            -> PutState (MissingChunks + stream), as tier_export

It reports the routing stats a worker reports (Worker.record_routing_stats) into the dict its
Serve `RunningReplica` view hands the router, live rather than once a second, each update
stamped `reported_at` as a worker's report is (the router adds only the sends after it).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict

from cache_service.client import CacheClient
from proto.contract import ConversationRef, tokens_digest

from bench.scale.cost_model import BATCH, IMPORT_TOKENS_PER_S, PREFILL_TOKENS_PER_S
from bench.scale.mix import Step

LEASE_TTL_MS = 30_000  # the app's lease_ttl_s (deployments/settings.py)
TOKEN = 7  # the token id every simulated token carries


class Latencies:
    """Seconds per call kind, recorded only while the window is open."""

    def __init__(self):
        self.open = False
        self.samples: dict[str, list[float]] = defaultdict(list)

    def add(self, kind: str, seconds: float) -> None:
        if self.open:
            self.samples[kind].append(seconds)


class SimulatedReplica:
    def __init__(self, name: str, cache: CacheClient, latencies: Latencies, state_bytes: int):
        self.name = name
        self.cache = cache
        self.latencies = latencies
        self.state_bytes = state_bytes
        self.slots = asyncio.Semaphore(BATCH)
        self.in_flight = 0  # sent here and not finished (waiting for a slot or running)
        self.waiting_prefill = 0
        # The dict the router reads as this replica's routing stats (updated in place).
        self.routing_stats = {"running_requests": 0, "waiting_prefill_tokens": 0,
                              "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
                              "import_tokens_per_s": IMPORT_TOKENS_PER_S, "mean_prefill_tokens": 0.0}
        self._prefill_seen = [0, 0]  # tokens, turns

    def _report(self) -> None:
        tokens, turns = self._prefill_seen
        self.routing_stats.update(reported_at=time.time(), running_requests=self.in_flight,
                                  waiting_prefill_tokens=self.waiting_prefill,
                                  mean_prefill_tokens=tokens / turns if turns else 0.0)

    async def run_turn(self, conv: ConversationRef, lease, head_version: int, committed: int, moved_tokens: int,
                       step: Step) -> tuple[int, int]:
        """Computes and publishes one turn; returns the new head's (version, committed tokens)."""
        work = step.work
        self.in_flight += 1
        self.waiting_prefill += work.new_prompt_tokens
        self._report()
        try:
            async with self.slots:
                self.waiting_prefill -= work.new_prompt_tokens
                self._prefill_seen[0] += work.new_prompt_tokens
                self._prefill_seen[1] += 1
                self._report()
                await asyncio.sleep(work.seconds(moved_tokens))
                new_tokens = [TOKEN] * (work.new_prompt_tokens + work.output_tokens)
                t0 = time.perf_counter()
                head = await self.cache.publish_turn(
                    conv, lease_token=lease, expected_version=head_version,
                    messages=[{"role": "user", "content": "x" * min(4 * work.new_prompt_tokens, 4000)},
                              {"role": "assistant", "content": "y" * min(4 * work.output_tokens, 4000)}],
                    token_ids=new_tokens, committed_tokens=committed + len(new_tokens),
                    tokens_sha256=tokens_digest(new_tokens), owner_replica=self.name)
                self.latencies.add("publish", time.perf_counter() - t0)
        finally:
            self.in_flight -= 1
            self._report()
        if step.export:
            t0 = time.perf_counter()
            await self.cache.put_state(conv, head, os.urandom(self.state_bytes))
            self.latencies.add("tier_put", time.perf_counter() - t0)
        return head.version, head.committed_tokens
