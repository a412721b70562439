"""Frozen, validated configuration of the cache service."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path


class FsyncPolicy(enum.Enum):
    """Redis `appendfsync`. What each can lose is documented in README.md."""

    ALWAYS = "always"
    EVERYSEC = "everysec"
    NO = "no"


@dataclass(frozen=True)
class Limits:
    """Bounds on client input; anything beyond is INVALID_ARGUMENT, nothing written."""

    max_id_bytes: int = 256            # conversation_id, cache_salt, holder, replica ids
    max_messages_per_turn: int = 1024
    max_turn_content_bytes: int = 4 << 20
    max_token_ids_per_turn: int = 1 << 20
    min_ttl_ms: int = 10
    max_ttl_ms: int = 3_600_000
    max_chunk_bytes: int = 4 << 20
    max_chunks_per_state: int = 1 << 16
    max_ledger_turns_per_read: int = 4096

    def __post_init__(self) -> None:
        if not 0 < self.min_ttl_ms <= self.max_ttl_ms:
            raise ValueError("need 0 < min_ttl_ms <= max_ttl_ms")
        if min(self.max_id_bytes, self.max_chunk_bytes, self.max_chunks_per_state) <= 0:
            raise ValueError("limits must be positive")

    @property
    def max_grpc_message_bytes(self) -> int:
        # A turn: content + up to 5 varint bytes per token id; a chunk: its data.
        # Plus slack for framing, so the typed limits above trip before gRPC's own.
        turn = self.max_turn_content_bytes + 5 * self.max_token_ids_per_turn
        return max(turn, self.max_chunk_bytes) + (1 << 20)


@dataclass(frozen=True)
class TierConfig:
    directory: Path
    memory_budget_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.memory_budget_bytes < 0:
            raise ValueError("memory_budget_bytes must be >= 0")


@dataclass(frozen=True)
class ServerConfig:
    tier: TierConfig
    redis_url: str | None = None       # None: start an embedded redis-server
    data_dir: Path = Path("data/cache_service")
    host: str = "127.0.0.1"
    port: int = 50051                  # 0: any free port (announced in the "serving" log line)
    fsync: FsyncPolicy = FsyncPolicy.ALWAYS  # only for the embedded redis-server
    redis_timeout_s: float = 5.0
    grace_s: float = 5.0
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"bad port {self.port}")
        if self.redis_timeout_s <= 0 or self.grace_s < 0:
            raise ValueError("timeouts must be positive")
