"""`python -m cache_service`: run the cache service.

Every flag has an environment variable as its default (flags win), read here at the
process boundary only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import re
from pathlib import Path

from cache_service import logs
from cache_service.config import EventLoop, FsyncPolicy, Limits, PutLimits, ServerConfig, TierConfig, TierPlacement
from cache_service.server import serve

# gen0 every 10,000 net allocations (the default is 700); older generations as by default.
GC_THRESHOLDS = (10_000, 10, 10)

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '2G', '64m' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2)]


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m cache_service", description=__doc__)
    p.add_argument("--redis-url", default=env("REDIS_URL"),
                   help="Redis URL [REDIS_URL]; unset: start an embedded redis-server")
    p.add_argument("--redis-sentinels", default=env("REDIS_SENTINELS"),
                   help="Redis under Sentinel instead of --redis-url: host:port,host:port,... of the sentinels "
                        "[REDIS_SENTINELS]; the primary's password, if any, from [REDIS_PASSWORD]")
    p.add_argument("--redis-cluster", default=env("REDIS_CLUSTER"),
                   help="a Redis Cluster instead of --redis-url: host:port,host:port,... of some of its nodes "
                        "[REDIS_CLUSTER]; their password, if any, from [REDIS_PASSWORD]")
    p.add_argument("--redis-master-name", default=env("REDIS_MASTER_NAME", "hybridserve"),
                   help="the primary's name in the sentinels' config [REDIS_MASTER_NAME]")
    p.add_argument("--publish-wait-replicas", type=int, default=int(env("CACHE_PUBLISH_WAIT_REPLICAS", "0")),
                   help="answer a ledger write OK only once this many Redis replicas have it (WAIT), else "
                        "UNAVAILABLE; 0 = once the primary has it [CACHE_PUBLISH_WAIT_REPLICAS]")
    p.add_argument("--publish-wait-timeout-ms", type=int,
                   default=int(env("CACHE_PUBLISH_WAIT_TIMEOUT_MS", "1000")),
                   help="how long a ledger write waits for its replicas [CACHE_PUBLISH_WAIT_TIMEOUT_MS]")
    p.add_argument("--host", default=env("CACHE_SERVICE_HOST", "127.0.0.1"), help="[CACHE_SERVICE_HOST]")
    p.add_argument("--port", type=int, default=int(env("CACHE_SERVICE_PORT", "50051")),
                   help="0 = any free port [CACHE_SERVICE_PORT]")
    p.add_argument("--data-dir", type=Path, default=Path(env("CACHE_DATA_DIR", "data/cache_service")),
                   help="embedded Redis data and default tier dir [CACHE_DATA_DIR]")
    p.add_argument("--tier-dir", type=Path, default=env("CACHE_TIER_DIR"),
                   help="state tier spill directory [CACHE_TIER_DIR] (default DATA_DIR/tier)")
    p.add_argument("--tier-budget", type=parse_bytes, default=parse_bytes(env("CACHE_TIER_BUDGET", "1GiB")),
                   help="state tier memory budget, e.g. 512MiB [CACHE_TIER_BUDGET]")
    p.add_argument("--prefix-tier-bytes", type=parse_bytes, default=env("CACHE_PREFIX_TIER_BYTES"),
                   help="bytes the tier's prefix checkpoints may hold, e.g. 256MiB [CACHE_PREFIX_TIER_BYTES] "
                        "(default a quarter of --tier-budget)")
    p.add_argument("--appendfsync", choices=[policy.value for policy in FsyncPolicy],
                   default=env("CACHE_REDIS_APPENDFSYNC", FsyncPolicy.ALWAYS.value),
                   help="AOF fsync policy of the embedded Redis [CACHE_REDIS_APPENDFSYNC]")
    p.add_argument("--grace-s", type=float, default=float(env("CACHE_SERVICE_GRACE_S", "5")),
                   help="shutdown grace period [CACHE_SERVICE_GRACE_S]")
    p.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"), help="[LOG_LEVEL]")
    p.add_argument("--event-loop", choices=[loop.value for loop in EventLoop],
                   default=env("CACHE_EVENT_LOOP", EventLoop.UVLOOP.value),
                   help="event loop; uvloop falls back to asyncio if not installed [CACHE_EVENT_LOOP]")
    limits, puts = Limits(), PutLimits()
    p.add_argument("--auth-token-file", type=Path, default=env("CACHE_SERVICE_AUTH_TOKEN_FILE"),
                   help="file holding the shared secret every call must carry "
                        "[CACHE_SERVICE_AUTH_TOKEN_FILE]; unset: no authentication")
    p.add_argument("--max-staged-bytes", type=parse_bytes,
                   default=parse_bytes(env("CACHE_MAX_STAGED_BYTES", str(puts.max_staged_bytes))),
                   help="bytes all unfinished state puts may hold [CACHE_MAX_STAGED_BYTES]")
    p.add_argument("--put-idle-timeout-s", type=float,
                   default=float(env("CACHE_PUT_IDLE_TIMEOUT_S", str(puts.idle_timeout_s))),
                   help="cut a state put silent this long [CACHE_PUT_IDLE_TIMEOUT_S]")
    p.add_argument("--max-lease-ttl-ms", type=int,
                   default=int(env("CACHE_MAX_LEASE_TTL_MS", str(limits.max_lease_ttl_ms))),
                   help="longest lease TTL granted [CACHE_MAX_LEASE_TTL_MS]")
    p.add_argument("--ledger-page-bytes", type=parse_bytes,
                   default=parse_bytes(env("CACHE_LEDGER_PAGE_BYTES", str(limits.ledger_page_bytes))),
                   help="ReadLedger page size [CACHE_LEDGER_PAGE_BYTES]")
    p.add_argument("--health-interval-s", type=float, default=float(env("CACHE_HEALTH_INTERVAL_S", "0.5")),
                   help="Redis probe period [CACHE_HEALTH_INTERVAL_S]")
    p.add_argument("--prefix-ttl-s", type=float, default=float(env("CACHE_PREFIX_TTL_S", "1800")),
                   help="a prefix-index entry lives this long after its last announce, a prefix checkpoint in "
                        "the tier after its last put or read [CACHE_PREFIX_TTL_S]")
    p.add_argument("--conversation-ttl-s", type=float,
                   default=float(env("CACHE_CONVERSATION_TTL_S", str(30 * 86400))),
                   help="a conversation expires this long after its last turn; 0 = never [CACHE_CONVERSATION_TTL_S]")
    p.add_argument("--tier-sweep-interval-s", type=float, default=float(env("CACHE_TIER_SWEEP_INTERVAL_S", "60")),
                   help="how often tier entries of expired conversations are dropped [CACHE_TIER_SWEEP_INTERVAL_S]")
    p.add_argument("--redis-maxmemory", type=parse_bytes, default=parse_bytes(env("CACHE_REDIS_MAXMEMORY", "1GiB")),
                   help="maxmemory of the embedded Redis (policy noeviction), 0 = none [CACHE_REDIS_MAXMEMORY]")
    p.add_argument("--tier-placement", choices=[t.value for t in TierPlacement],
                   default=env("CACHE_TIER_PLACEMENT", TierPlacement.SINGLE.value),
                   help="single: one instance holds the tier; rendezvous: several instances on one Redis, "
                        "entries placed by the clients [CACHE_TIER_PLACEMENT]")
    return p


def _addresses(text: str | None) -> tuple[str, ...]:
    return tuple(a.strip() for a in (text or "").split(",") if a.strip())


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    tier_dir = args.tier_dir or args.data_dir / "tier"
    auth = None
    if args.auth_token_file:
        auth = args.auth_token_file.read_text().strip()
        if not auth:  # asked for authentication: an empty secret must not turn it off
            raise ValueError(f"--auth-token-file {args.auth_token_file} is empty: write the shared secret "
                             "in it (or leave the flag out to run without authentication)")
    return ServerConfig(
        tier=TierConfig(directory=Path(tier_dir), memory_budget_bytes=args.tier_budget,
                        prefix_bytes=args.prefix_tier_bytes),
        redis_url=args.redis_url or None,
        redis_sentinels=_addresses(args.redis_sentinels),
        redis_cluster=_addresses(args.redis_cluster),
        redis_master_name=args.redis_master_name, redis_password=os.environ.get("REDIS_PASSWORD") or None,
        publish_wait_replicas=args.publish_wait_replicas, publish_wait_timeout_ms=args.publish_wait_timeout_ms,
        data_dir=args.data_dir, host=args.host,
        port=args.port, fsync=FsyncPolicy(args.appendfsync), grace_s=args.grace_s,
        limits=Limits(max_lease_ttl_ms=args.max_lease_ttl_ms, ledger_page_bytes=args.ledger_page_bytes),
        puts=PutLimits(max_staged_bytes=args.max_staged_bytes, idle_timeout_s=args.put_idle_timeout_s),
        auth_token=auth, health_interval_s=args.health_interval_s, prefix_ttl_s=args.prefix_ttl_s,
        conversation_ttl_s=args.conversation_ttl_s, tier_sweep_interval_s=args.tier_sweep_interval_s,
        redis_maxmemory_bytes=args.redis_maxmemory, tier_placement=TierPlacement(args.tier_placement))


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    logs.configure(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as e:  # a flag's value is wrong: say which, exit 2, no traceback
        parser.error(str(e))
    loop_factory = None
    if EventLoop(args.event_loop) is EventLoop.UVLOOP:
        try:
            import uvloop
            loop_factory = uvloop.new_event_loop
        except ImportError:
            logging.getLogger("cache_service").warning(
                "event_loop_fallback", extra=logs.fields(reason="uvloop is not installed"))
    # Every RPC allocates a few hundred short-lived objects (gRPC's call state, protobuf
    # messages, redis-py's reply): with the default thresholds the collector ran often, its
    # older generations walking every object loaded at start (4% of the service's samples in a
    # profile under load). Those are frozen out of collection; the young generation is
    # collected less often.
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(config))


if __name__ == "__main__":
    main()
