"""`python -m cache_service`: run the cache service.

Every flag has an environment variable as its default (flags win), read here at the
process boundary only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from pathlib import Path

from cache_service import logs
from cache_service.config import FsyncPolicy, ServerConfig, TierConfig
from cache_service.server import serve

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
    p.add_argument("--host", default=env("CACHE_SERVICE_HOST", "127.0.0.1"), help="[CACHE_SERVICE_HOST]")
    p.add_argument("--port", type=int, default=int(env("CACHE_SERVICE_PORT", "50051")),
                   help="0 = any free port [CACHE_SERVICE_PORT]")
    p.add_argument("--data-dir", type=Path, default=Path(env("CACHE_DATA_DIR", "data/cache_service")),
                   help="embedded Redis data and default tier dir [CACHE_DATA_DIR]")
    p.add_argument("--tier-dir", type=Path, default=env("CACHE_TIER_DIR"),
                   help="state tier spill directory [CACHE_TIER_DIR] (default DATA_DIR/tier)")
    p.add_argument("--tier-budget", type=parse_bytes, default=parse_bytes(env("CACHE_TIER_BUDGET", "1GiB")),
                   help="state tier memory budget, e.g. 512MiB [CACHE_TIER_BUDGET]")
    p.add_argument("--appendfsync", choices=[policy.value for policy in FsyncPolicy],
                   default=env("CACHE_REDIS_APPENDFSYNC", FsyncPolicy.ALWAYS.value),
                   help="AOF fsync policy of the embedded Redis [CACHE_REDIS_APPENDFSYNC]")
    p.add_argument("--grace-s", type=float, default=float(env("CACHE_SERVICE_GRACE_S", "5")),
                   help="shutdown grace period [CACHE_SERVICE_GRACE_S]")
    p.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"), help="[LOG_LEVEL]")
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    tier_dir = args.tier_dir or args.data_dir / "tier"
    return ServerConfig(
        tier=TierConfig(directory=Path(tier_dir), memory_budget_bytes=args.tier_budget),
        redis_url=args.redis_url or None, data_dir=args.data_dir, host=args.host,
        port=args.port, fsync=FsyncPolicy(args.appendfsync), grace_s=args.grace_s)


def main() -> None:
    args = build_parser().parse_args()
    logs.configure(args.log_level)
    asyncio.run(serve(config_from_args(args)))


if __name__ == "__main__":
    main()
