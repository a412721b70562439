"""One point of the sweep: R simulated replicas, N stored conversations, I service instances.

    sessions (closed loop, min(R x BATCH, max_sessions) of them), each over and over:
        draw a conversation and a session of the mix (mix.py)
        per turn:  AcquireLease (ingress; its reply carries the head)
                   renew the lease every TTL / RENEWALS_PER_TTL until the turn ends (ingress)
                   route: StickyConversationRouter.choose_replicas, the first rank with room (fleet.py)
                   the chosen replica computes, publishes, exports (replica.py)

A warm-up, then a measured window: turns, call latencies, Redis counters and CPU times are the
window's. At the end every turn the sessions completed is checked against the ledgers in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from cache_service.client import CacheClient
from cache_service.errors import CacheError, LeaseLost
from deployments.messages import HeadRef, TurnJob
from deployments.routing.decisions import ROUTING_REGISTRY
from deployments.routing.cost import RouteReason
from deployments.turn.lease_keeper import RENEWALS_PER_TTL

from bench.kit.stats import percentile
from bench.scale import services
from bench.scale.cost_model import BATCH
from bench.scale.fleet import Fleet
from bench.scale.mix import session
from bench.scale.replica import LEASE_TTL_MS, Latencies, SimulatedReplica


@dataclass(frozen=True)
class Point:
    replicas: int
    conversations: int
    instances: int


@dataclass(frozen=True)
class Plan:
    points: tuple[Point, ...]
    warmup_s: float
    measure_s: float
    max_sessions: int  # concurrent sessions at most: past the service's saturation more only queue
    state_bytes: int  # one exported head


class Counts:
    def __init__(self):
        self.turns = 0  # all completed turns (warm-up included): checked against the ledgers
        self.window_turns = 0
        self.touched: set[int] = set()
        self.busy: set[int] = set()  # conversations a session is running now
        self.errors: dict[str, int] = {}


async def run_session_loop(index: int, cache: CacheClient, fleet: Fleet, point: Point, counts: Counts,
                           latencies: Latencies, stop: asyncio.Event) -> None:
    rng = random.Random(index)
    while not stop.is_set():
        number = rng.randrange(point.conversations)
        if number in counts.busy:  # one user per conversation: its next turn waits for this one
            await asyncio.sleep(0)
            continue
        counts.busy.add(number)
        counts.touched.add(number)
        try:
            await run_session(index, services.conversation(number), session(rng), cache, fleet, counts, latencies,
                              stop)
        finally:
            counts.busy.discard(number)


async def run_session(index: int, conv, steps, cache: CacheClient, fleet: Fleet, counts: Counts,
                      latencies: Latencies, stop: asyncio.Event) -> None:
    for step in steps:
        if stop.is_set():
            return
        try:
            t0 = time.perf_counter()
            lease = await cache.acquire_lease(conv, LEASE_TTL_MS, holder=f"ingress:{index}")
            latencies.add("acquire", time.perf_counter() - t0)
            head = HeadRef.of(lease.head)
            job = TurnJob(uuid.uuid4().hex, [], {}, conversation=conv, lease=lease, head=head)
            async with kept(cache, conv, lease, latencies):
                replica = await fleet.route(job)
                moved = head.committed_tokens if head.owner and head.owner != replica.name else 0
                try:
                    await replica.run_turn(conv, lease, head.version, head.committed_tokens, moved, step)
                finally:
                    fleet.finished(replica)
        except Exception as error:  # counted and reported: a point with errors is not a clean point
            counts.errors[type(error).__name__] = counts.errors.get(type(error).__name__, 0) + 1
            return
        counts.turns += 1
        if latencies.open:
            counts.window_turns += 1


@contextlib.asynccontextmanager
async def kept(cache: CacheClient, conv, lease, latencies: Latencies):
    """The lease renewed from its grant until the turn ends, as the ingress's lease keeper does
    (deployments/turn/run.py): also while the turn waits for a replica with room or for a slot."""
    task = asyncio.create_task(_renew(cache, conv, lease, latencies))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _renew(cache: CacheClient, conv, lease, latencies: Latencies) -> None:
    period = LEASE_TTL_MS / 1000 / RENEWALS_PER_TTL
    while True:
        await asyncio.sleep(period)
        t0 = time.perf_counter()
        try:
            await cache.renew_lease(conv, lease, LEASE_TTL_MS)
        except LeaseLost:  # definite: the publish fails with it too, and is counted there
            return
        except CacheError:  # anything else: the next tick is the retry, as the ingress's keeper does
            continue
        latencies.add("renew", time.perf_counter() - t0)


def reason_counts() -> dict[str, float]:
    return {r.value: ROUTING_REGISTRY.get_sample_value("hybridserve_route_decisions_total", {"reason": r.value})
            for r in RouteReason}


def quantiles_ms(samples: list[float]) -> dict:
    return {"count": len(samples), "p50_ms": 1000 * percentile(samples, 50) if samples else None,
            "p99_ms": 1000 * percentile(samples, 99) if samples else None}


async def measure(point: Point, plan: Plan, deployment: services.Deployment) -> dict:
    latencies, counts, stop = Latencies(), Counts(), asyncio.Event()
    sessions = min(point.replicas * BATCH, plan.max_sessions)
    async with CacheClient(deployment.target) as cache:
        await cache.wait_ready()
        replicas = [SimulatedReplica(f"replica-{i}", cache, latencies, plan.state_bytes)
                    for i in range(point.replicas)]
        fleet = Fleet(replicas)
        tasks = [asyncio.create_task(run_session_loop(i, cache, fleet, point, counts, latencies, stop))
                 for i in range(sessions)]
        await asyncio.sleep(plan.warmup_s)
        redis_before, cpu_before, reasons_before = (services.redis_counters(deployment.redis.url),
                                                    deployment.cpu_seconds(), reason_counts())
        route_from, driver_cpu, started = len(fleet.route_seconds), time.process_time(), time.perf_counter()
        latencies.open = True
        await asyncio.sleep(plan.measure_s)
        latencies.open = False
        seconds, driver_cpu = time.perf_counter() - started, time.process_time() - driver_cpu
        redis_after, cpu_after, reasons_after = (services.redis_counters(deployment.redis.url),
                                                 deployment.cpu_seconds(), reason_counts())
        route_seconds = fleet.route_seconds[route_from:]
        stop.set()
        await asyncio.gather(*tasks)
    touched = sorted(counts.touched)
    in_ledgers = services.ledger_turns(deployment.redis.url, touched) - len(touched)  # less the seeded turn
    turns = counts.window_turns
    commands = {k: redis_after["by_command"].get(k, 0) - v for k, v in redis_before["by_command"].items()}
    commands.update({k: v for k, v in redis_after["by_command"].items() if k not in redis_before["by_command"]})
    cpu = {k: (cpu_after[k] - cpu_before[k]) / seconds for k in cpu_after}
    cpu["driver"] = driver_cpu / seconds
    tier = latencies.samples["tier_put"]
    return {
        "point": asdict(point), "sessions": sessions, "seconds": seconds,
        "turns": turns, "turns_per_s": turns / seconds, "turns_per_s_per_instance": turns / seconds / point.instances,
        "turns_completed_all": counts.turns, "turns_in_ledgers": in_ledgers,
        "conversations_touched": len(touched), "errors": counts.errors,
        "latency": {kind: quantiles_ms(latencies.samples[kind])
                    for kind in ("acquire", "publish", "renew", "tier_put")},
        "route": {"count": len(route_seconds), "p50_ms": 1000 * percentile(route_seconds, 50) if route_seconds else None,
                  "mean_ms": 1000 * sum(route_seconds) / len(route_seconds) if route_seconds else None,
                  "reasons": {k: reasons_after[k] - reasons_before[k] for k in reasons_after}},
        "redis": {"commands": redis_after["commands"] - redis_before["commands"],
                  "commands_per_turn": (redis_after["commands"] - redis_before["commands"]) / max(turns, 1),
                  "evalsha_per_turn": commands.get("evalsha", 0) / max(turns, 1),
                  "by_command_per_turn": {k: v / max(turns, 1) for k, v in sorted(commands.items()) if v},
                  "bytes_in_per_turn": (redis_after["net_in_bytes"] - redis_before["net_in_bytes"]) / max(turns, 1),
                  "bytes_out_per_turn": (redis_after["net_out_bytes"] - redis_before["net_out_bytes"]) / max(turns, 1),
                  "used_memory": redis_after["used_memory"]},
        "tier": {"puts": len(tier), "bytes": len(tier) * plan.state_bytes,
                 "MBps": len(tier) * plan.state_bytes / seconds / 1e6},
        "cpu_cores": cpu,
    }


async def run_point(point: Point, plan: Plan) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        with services.deployed(Path(tmp), point.instances, max(256 << 20, 64 * plan.state_bytes)) as deployment:
            memory_before = services.redis_counters(deployment.redis.url)["used_memory"]
            t0 = time.perf_counter()
            services.seed(deployment.redis.url, point.conversations)
            seed_s = time.perf_counter() - t0
            seeded_memory = services.redis_counters(deployment.redis.url)["used_memory"] - memory_before
            result = await measure(point, plan, deployment)
    result["seed"] = {"seconds": seed_s, "per_s": point.conversations / seed_s,
                      "redis_bytes_per_conversation": seeded_memory / point.conversations}
    return result
