"""Cache service benchmark: `python -m bench.cache_service [--quick]`.

Measures the turn-bookkeeping cycle a router + worker perform per turn,
    acquire lease (the reply carries the head) -> publish turn (releasing the lease),
through the gRPC service (a real `python -m cache_service` process) and, as the floor,
the very same Redis operations (the same two Lua scripts, same arguments) issued
directly with redis-py, and the gRPC floor: the same client cycle against bench/kit/grpc_floor.py, a
server that answers with fixed replies. Each of C concurrent clients works on its own conversation, so the numbers
measure overhead, not lease contention. Also measures state tier put/get throughput
(fresh and incremental puts), next to plain redis-py SET/GET of the same bytes.

Writes bench/results/cache_service.json and bench/results/cache_service.md (--smoke:
cache_service.smoke.*, --results-dir elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import redis
import redis.asyncio as aioredis
from redis.utils import HIREDIS_AVAILABLE

from bench.kit.results import RESULTS_DIR, write_results
from bench.kit.stats import nearest_rank
from cache_service import scripts
from cache_service.client import CacheClient
from cache_service.config import FsyncPolicy, ServerConfig
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from cache_service.keys import ConversationKeys
from cache_service.launch import CacheServiceChild
from cache_service.leases import new_incarnation
from cache_service.store import now_ms
from proto import cache_pb2 as pb
from proto.contract import ConversationRef, tokens_digest

TOKENS_PER_TURN = 64
MESSAGE = "x" * 400  # a short chat message
# The service runs with its default retention: the floor's scripts set the same TTLs.
CONVERSATION_TTL_MS = int(ServerConfig.conversation_ttl_s * 1000)


@dataclass(frozen=True)
class Plan:
    seconds_per_point: float  # per side (service, raw Redis), split into `rounds` slices
    rounds: int
    concurrency: tuple[int, ...]
    state_bytes: int
    tier_budget: int
    fsync: tuple[FsyncPolicy, ...]


FULL = Plan(10.0, 10, (1, 16, 64), 64 << 20, 256 << 20, (FsyncPolicy.EVERYSEC, FsyncPolicy.ALWAYS))
QUICK = Plan(1.5, 3, (1, 16, 64), 16 << 20, 64 << 20, (FsyncPolicy.EVERYSEC,))
SMOKE = Plan(0.2, 1, (1, 4), 1 << 20, 8 << 20, (FsyncPolicy.EVERYSEC,))  # proves it runs, measures nothing


@dataclass
class Point:
    cycles: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def cycles_per_s(self) -> float:
        return self.cycles / self.seconds


@dataclass
class Samples:
    latencies_ms: list[float]
    seconds: float = 0.0

    def point(self) -> Point:
        return Point(len(self.latencies_ms), self.seconds, statistics.median(self.latencies_ms),
                     nearest_rank(self.latencies_ms, 0.99))


async def run_slice(cycles, seconds: float, samples: Samples) -> None:
    """Run every cycle() in its own loop for `seconds`, appending latencies."""
    stop_at = time.perf_counter() + seconds

    async def loop(cycle) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await cycle()
            samples.latencies_ms.append((time.perf_counter() - t0) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in cycles))
    samples.seconds += time.perf_counter() - started


async def compare(concurrency: int, seconds: float, rounds: int, *factories):
    """Alternate short slices of each side (service, raw Redis, gRPC floor) so all see the same
    machine load (this box is shared; a quiet minute for one side and a busy one for another
    would make any ratio meaningless)."""
    sides = []
    for factory in factories:
        cycles = [await factory(i) for i in range(concurrency)]
        for cycle in cycles:  # warm-up: connections, script cache, first head
            await cycle()
        sides.append((cycles, Samples([])))
    for _ in range(rounds):
        for cycles, samples in sides:
            await run_slice(cycles, seconds / rounds, samples)
    return [samples.point() for _, samples in sides]


def service_cycle_factory(client: CacheClient):
    async def make(i: int):
        conv = ConversationRef(f"bench-{uuid.uuid4().hex}", "salt")
        state = {"tokens": 0}
        new_tokens = list(range(TOKENS_PER_TURN))
        messages = [{"role": "user", "content": MESSAGE}]

        async def cycle() -> None:
            lease = await client.acquire_lease(conv, ttl_ms=30_000)
            state["tokens"] += TOKENS_PER_TURN
            await client.publish_turn(conv, lease_token=lease, expected_version=lease.head.version,
                                      messages=messages, token_ids=new_tokens,
                                      committed_tokens=state["tokens"],
                                      tokens_sha256=tokens_digest(new_tokens), owner_replica="r0")
        return cycle
    return make


def redis_cycle_factory(r: aioredis.Redis):
    acquire = r.register_script(scripts.ACQUIRE)
    publish = r.register_script(scripts.PUBLISH)

    async def make(i: int):
        keys = ConversationKeys.of(ConversationRef(f"raw-{uuid.uuid4().hex}", "salt"))
        state = {"tokens": 0}
        new_tokens = list(range(TOKENS_PER_TURN))
        sha = tokens_digest(new_tokens)

        async def cycle() -> None:
            holder = uuid.uuid4().hex
            attempt = hashlib.sha256(os.urandom(16)).hexdigest()
            reply = await acquire(keys=[keys.lease, keys.fence, keys.head, keys.ledger, keys.marks],
                                  args=[holder, 30_000, attempt, new_incarnation(), 30_000 + 3_600_000,
                                        str(CONVERSATION_TTL_MS + 30_000)])
            token, incarnation, head = reply[1], reply[2], reply[4]
            version = int(head[0] or 0)
            state["tokens"] += TOKENS_PER_TURN
            entry = pb.LedgerTurn(messages=[pb.Message(role="user", content=MESSAGE)],
                                  token_ids=new_tokens, publish_id=holder, committed_at_ms=now_ms())
            reply = await publish(keys=[keys.head, keys.lease, keys.ledger, keys.marks],
                                  args=[token, incarnation, version, entry.SerializeToString(),
                                        state["tokens"], sha, "r0", entry.committed_at_ms, 1, holder,
                                        TOKENS_PER_TURN, attempt, new_incarnation(), str(CONVERSATION_TTL_MS)])
            assert reply[0] == b"OK", reply
        return cycle
    return make


def start_floor() -> tuple[subprocess.Popen, str]:
    """bench/kit/grpc_floor.py: the same client cycle against a server that does nothing."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.kit.grpc_floor"], stdout=subprocess.PIPE, text=True)
    return proc, f"127.0.0.1:{int(proc.stdout.readline())}"


def start_service(redis_url: str, data_dir: Path, tier_budget: int) -> tuple[CacheServiceChild, str]:
    child = CacheServiceChild(["--port", "0", "--data-dir", str(data_dir), "--tier-budget", str(tier_budget),
                               "--log-level", "INFO"], redis_url=redis_url)
    return child, f"127.0.0.1:{child.start()}"


async def bench_cycles(plan: Plan, fsync: FsyncPolicy, workdir: Path) -> dict:
    out = {}
    with EmbeddedRedis(EmbeddedRedisConfig(data_dir=workdir / f"redis-{fsync.value}", fsync=fsync)) as server:
        service, target = start_service(server.url, workdir / f"svc-{fsync.value}", plan.tier_budget)
        floor_proc, floor_target = start_floor()
        try:
            raw = aioredis.Redis.from_url(server.url, max_connections=256)
            async with CacheClient(target) as client, CacheClient(floor_target) as floor_client:
                await client.wait_ready()
                await floor_client.wait_ready()
                for c in plan.concurrency:
                    svc, floor, grpc_only = await compare(
                        c, plan.seconds_per_point, plan.rounds, service_cycle_factory(client),
                        redis_cycle_factory(raw), service_cycle_factory(floor_client))
                    out[str(c)] = {
                        "service": {**asdict(svc), "cycles_per_s": svc.cycles_per_s},
                        "redis": {**asdict(floor), "cycles_per_s": floor.cycles_per_s},
                        "grpc_floor": {**asdict(grpc_only), "cycles_per_s": grpc_only.cycles_per_s},
                        # time per cycle through the service / time per cycle on raw Redis
                        "overhead_ratio_vs_redis": floor.cycles_per_s / svc.cycles_per_s,
                        "p50_ratio_vs_redis": svc.p50_ms / floor.p50_ms,
                        # the same for the gRPC floor: what the service's ratio cannot go below
                        "grpc_floor_ratio_vs_redis": floor.cycles_per_s / grpc_only.cycles_per_s,
                    }
                    print(f"[{fsync.value}] c={c:3d} service {svc.cycles_per_s:8.0f}/s p50 {svc.p50_ms:6.2f} ms "
                          f"p99 {svc.p99_ms:6.2f} ms | redis {floor.cycles_per_s:8.0f}/s "
                          f"p50 {floor.p50_ms:6.2f} ms | grpc floor {grpc_only.cycles_per_s:8.0f}/s | ratio "
                          f"{out[str(c)]['overhead_ratio_vs_redis']:.2f} (floor "
                          f"{out[str(c)]['grpc_floor_ratio_vs_redis']:.2f})", flush=True)
            await raw.aclose()
        finally:
            floor_proc.kill()
            floor_proc.wait()
            service.stop(30)
    return out


async def bench_tier(plan: Plan, workdir: Path) -> dict:
    data = os.urandom(plan.state_bytes)
    mib = plan.state_bytes / (1 << 20)
    with EmbeddedRedis(EmbeddedRedisConfig(data_dir=workdir / "redis-tier", fsync=FsyncPolicy.EVERYSEC)) as server:
        service, target = start_service(server.url, workdir / "svc-tier", plan.tier_budget)
        try:
            async with CacheClient(target) as client:
                conv = ConversationRef(f"tier-{uuid.uuid4().hex}", "salt")
                lease = await client.acquire_lease(conv, ttl_ms=60_000)
                head = await client.publish_turn(conv, lease_token=lease, expected_version=0, messages=[],
                                                 token_ids=[1], committed_tokens=1, tokens_sha256=tokens_digest([1]),
                                                 release_lease=False)
                t0 = time.perf_counter()
                await client.put_state(conv, head, data)
                put_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                _, back = await client.get_state(conv)
                get_s = time.perf_counter() - t0
                assert back == data
                # Next turn: the same blocks plus one new 1 MiB chunk at the end.
                head = await client.publish_turn(conv, lease_token=lease, expected_version=1, messages=[],
                                                 token_ids=[2], committed_tokens=2,
                                                 tokens_sha256=tokens_digest([1, 2]))
                t0 = time.perf_counter()
                reply = await client.put_state(conv, head, data + os.urandom(1 << 20))
                inc_s = time.perf_counter() - t0
        finally:
            service.stop(30)
        r = redis.Redis.from_url(server.url)
        chunks = [data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)]
        t0 = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for i, chunk in enumerate(chunks):
            pipe.set(f"bench:chunk:{i}", chunk)
        pipe.execute()
        set_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert b"".join(r.mget([f"bench:chunk:{i}" for i in range(len(chunks))])) == data
        mget_s = time.perf_counter() - t0
        r.close()
    return {
        "state_mib": mib,
        "put_MBps": mib / put_s, "get_MBps": mib / get_s,
        "incremental_put_MBps": (mib + 1) / inc_s,
        "incremental_chunks_sent": reply.chunks_sent, "incremental_chunks_reused": reply.chunks_reused,
        "redis_set_MBps": mib / set_s, "redis_get_MBps": mib / mget_s,
    }


def compared(results: dict, before: dict) -> list[str]:
    """An earlier run's cycle figures (its primary fsync policy) beside this run's."""
    fsync = results["primary_fsync"]
    old, new = before["cycles"].get(fsync, {}), results["cycles"][fsync]
    env = before["env"]
    lines = [f"## Before and after (appendfsync {fsync})", "",
             f"Before: a {before['mode']} run, load average {env['load_avg_before'][0]:.1f} / "
             f"{env['load_avg_after'][0]:.1f}, redis-py {env['redis_py']}, hiredis {env.get('hiredis', False)}.", "",
             "| clients | service cycles/s before | after | redis-py cycles/s before | after "
             "| overhead ratio before | after | gRPC floor ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c, p in new.items():
        if c not in old:
            continue
        b = old[c]
        lines.append(f"| {c} | {b['service']['cycles_per_s']:.0f} | {p['service']['cycles_per_s']:.0f} | "
                     f"{b['redis']['cycles_per_s']:.0f} | {p['redis']['cycles_per_s']:.0f} | "
                     f"{b['overhead_ratio_vs_redis']:.2f}× | {p['overhead_ratio_vs_redis']:.2f}× | "
                     f"{p['grpc_floor_ratio_vs_redis']:.2f}× |")
    return lines + [""]


def markdown(results: dict, before: dict | None = None) -> str:
    lines = ["# Cache service benchmark", "",
             f"{results['mode']} run, {results['env']['cpus']} CPUs, {results['seconds_per_point']} s per side "
             f"and point (alternating slices), load average {results['env']['load_avg_before'][0]:.1f} "
             f"before / {results['env']['load_avg_after'][0]:.1f} after (shared machine). "
             "Cycle = acquire lease (its reply carries the head) + publish turn (release). "
             "Floor = the same two Lua scripts, same arguments, straight from redis-py. "
             "Ratio = time per cycle through the service / on raw Redis. gRPC floor = the same client cycle "
             "against a server that answers both calls with fixed replies and does nothing else "
             "(bench/kit/grpc_floor.py): gRPC and the client alone, below which no change to the service's "
             "handlers can take the ratio.", ""]
    for fsync, points in results["cycles"].items():
        lines += [f"## appendfsync {fsync}", "",
                  "| clients | service cycles/s | p50 ms | p99 ms "
                  "| redis-py cycles/s | p50 ms | p99 ms | overhead ratio | gRPC floor cycles/s | p50 ms "
                  "| floor ratio |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c, p in points.items():
            s, f, g = p["service"], p["redis"], p["grpc_floor"]
            lines.append(f"| {c} | {s['cycles_per_s']:.0f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
                         f"{f['cycles_per_s']:.0f} | {f['p50_ms']:.2f} | {f['p99_ms']:.2f} | "
                         f"{p['overhead_ratio_vs_redis']:.2f}× | {g['cycles_per_s']:.0f} | {g['p50_ms']:.2f} | "
                         f"{p['grpc_floor_ratio_vs_redis']:.2f}× |")
        lines.append("")
    if before is not None:
        lines += compared(results, before)
    t = results["tier"]
    lines += [f"## State tier ({t['state_mib']:.0f} MiB head)", "",
              "| operation | MB/s |", "|---|---:|",
              f"| put (all chunks new) | {t['put_MBps']:.0f} |",
              f"| put, next version ({t['incremental_chunks_sent']} chunk sent, "
              f"{t['incremental_chunks_reused']} reused) | {t['incremental_put_MBps']:.0f} |",
              f"| get (checksums verified both ends) | {t['get_MBps']:.0f} |",
              f"| redis-py SET, 1 MiB values (reference) | {t['redis_set_MBps']:.0f} |",
              f"| redis-py MGET, 1 MiB values (reference) | {t['redis_get_MBps']:.0f} |", ""]
    return "\n".join(lines)


async def main_async(plan: Plan, mode: str) -> dict:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        workdir = Path(tmp)
        cycles = {f.value: await bench_cycles(plan, f, workdir) for f in plan.fsync}
        tier = await bench_tier(plan, workdir)
    primary = cycles[plan.fsync[0].value]
    return {
        "mode": mode,
        "seconds_per_point": plan.seconds_per_point,
        "env": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpc": grpc.__version__,
                "redis_py": redis.__version__, "hiredis": HIREDIS_AVAILABLE, "load_avg_before": load_before,
                "load_avg_after": os.getloadavg()},
        "primary_fsync": plan.fsync[0].value,
        "overhead_ratio_vs_redis": {c: p["overhead_ratio_vs_redis"] for c, p in primary.items()},
        "cycles": cycles,
        "tier": tier,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--smoke", action="store_true", help="a fraction of a second per point: proves it runs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    plan, mode = (SMOKE, "smoke") if args.smoke else (QUICK, "quick") if args.quick else (FULL, "full")
    results = asyncio.run(main_async(plan, mode))
    name = "cache_service.smoke" if args.smoke else "cache_service"
    # An earlier run kept beside this one (cache_service.before.json) is compared in the Markdown.
    before_path = args.results_dir / f"{name}.before.json"
    before = json.loads(before_path.read_text()) if before_path.exists() else None
    write_results(name, results, markdown(results, before), args.results_dir)
    print(markdown(results, before))


if __name__ == "__main__":
    main()
