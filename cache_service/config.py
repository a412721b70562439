"""Frozen, validated configuration of the cache service."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from cache_service.redis_connect import ClusterTarget, SentinelTarget


class EventLoop(enum.Enum):
    """The service's event loop. uvloop halves the loop's own cost per RPC (Redis
    socket I/O and callbacks run on it); asyncio is the fallback without it."""

    UVLOOP = "uvloop"
    ASYNCIO = "asyncio"


class FsyncPolicy(enum.Enum):
    """Redis `appendfsync`. What each can lose is documented in README.md."""

    ALWAYS = "always"
    EVERYSEC = "everysec"
    NO = "no"


class TierPlacement(enum.Enum):
    """Who holds the state tier's entries, and so what a head's `tier_version` reports.

    SINGLE: this one instance holds every entry; a head reports the version its own tier holds
    (the only truth after a restart emptied it). RENDEZVOUS: several instances share one Redis and
    the clients place each entry on some of them (cache_service/placement.py); the instance that
    answers a head rarely holds its entry, so a head reports what Redis recorded at the last
    accepted put. An entry lost with its instance is then found missing at import, and the
    worker recomputes from the ledger."""

    SINGLE = "single"
    RENDEZVOUS = "rendezvous"


@dataclass(frozen=True)
class Limits:
    """Bounds on client input; anything beyond is INVALID_ARGUMENT, nothing written."""

    max_id_bytes: int = 256            # conversation_id, cache_salt, holder
    max_messages_per_turn: int = 1024
    max_turn_content_bytes: int = 4 << 20
    max_token_ids_per_turn: int = 1 << 20
    min_ttl_ms: int = 10
    max_lease_ttl_ms: int = 300_000    # a lease lives at most this long without a renewal
    max_chunk_bytes: int = 4 << 20
    max_chunks_per_state: int = 1 << 16
    max_ledger_turns_per_read: int = 4096
    ledger_page_bytes: int = 4 << 20   # one ReadLedger page (a single larger turn still fits)
    max_prefix_entries: int = 256      # names per AnnouncePrefixes / ForgetPrefixes
    max_prefix_names: int = 512        # names per FindPrefix (a chat's messages, one name each)

    def __post_init__(self) -> None:
        if not 0 < self.min_ttl_ms <= self.max_lease_ttl_ms:
            raise ValueError("need 0 < min_ttl_ms <= max_lease_ttl_ms")
        if min(self.max_id_bytes, self.max_chunk_bytes, self.max_chunks_per_state,
               self.ledger_page_bytes, self.max_prefix_entries, self.max_prefix_names) <= 0:
            raise ValueError("limits must be positive")

    @property
    def max_turn_bytes(self) -> int:
        """Bound on one serialized ledger turn: content + up to 5 varint bytes per token
        id + per-message framing. Checked on the serialized turn, so nothing stored can
        be larger than a reply may carry."""
        return self.max_turn_content_bytes + 5 * self.max_token_ids_per_turn + 16 * self.max_messages_per_turn

    @property
    def max_grpc_message_bytes(self) -> int:
        # The largest of a turn, a ledger page and a chunk, plus slack for framing, so
        # the typed limits above trip before gRPC's own.
        return max(self.max_turn_bytes, self.ledger_page_bytes, self.max_chunk_bytes) + (1 << 20)


@dataclass(frozen=True)
class TierConfig:
    directory: Path
    memory_budget_bytes: int = 1 << 30
    # Bytes prefix checkpoints (prefix_tier.py) may hold, memory and disk together; None: a
    # quarter of the memory budget. They are hints anyone may put, so they must not crowd out
    # the heads, whose loss costs a whole conversation's recompute.
    prefix_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.memory_budget_bytes < 0:
            raise ValueError("memory_budget_bytes must be >= 0")
        if self.prefix_bytes is not None and self.prefix_bytes < 0:
            raise ValueError("prefix_bytes must be >= 0")

    @property
    def prefix_budget_bytes(self) -> int:
        return self.memory_budget_bytes // 4 if self.prefix_bytes is None else self.prefix_bytes


@dataclass(frozen=True)
class PutLimits:
    """Bounds on PutState streams, which hold their chunks in memory until committed."""

    # All streams together; beyond: RESOURCE_EXHAUSTED. Also the most one put may send
    # (the chunks the tier lacks), so it must exceed the largest exported head.
    max_staged_bytes: int = 1 << 30
    idle_timeout_s: float = 30.0       # a stream silent this long is cut (DEADLINE_EXCEEDED)

    def __post_init__(self) -> None:
        if self.max_staged_bytes <= 0 or self.idle_timeout_s <= 0:
            raise ValueError("put limits must be positive")


@dataclass(frozen=True)
class ServerConfig:
    tier: TierConfig
    redis_url: str | None = None       # None (and no sentinels): start an embedded redis-server
    # Redis under Sentinel instead of one URL: each sentinel's "host:port" and the name of the
    # primary they watch; the service follows a failover to the promoted replica.
    redis_sentinels: tuple[str, ...] = ()
    redis_master_name: str = "hybridserve"
    redis_password: str | None = field(default=None, repr=False)  # the primary's (Sentinel), the nodes' (Cluster)
    # A Redis Cluster instead: some of its nodes ("host:port" each); the client finds the rest.
    redis_cluster: tuple[str, ...] = ()
    # A ledger write (publish, acquire, ...) is answered OK only once this many replicas
    # acknowledged it (Redis WAIT), else UNAVAILABLE; 0: once the primary has it.
    publish_wait_replicas: int = 0
    publish_wait_timeout_ms: int = 1000
    data_dir: Path = Path("data/cache_service")
    host: str = "127.0.0.1"
    port: int = 50051                  # 0: any free port (announced in the "serving" log line)
    fsync: FsyncPolicy = FsyncPolicy.ALWAYS  # only for the embedded redis-server
    redis_timeout_s: float = 5.0
    grace_s: float = 5.0
    limits: Limits = field(default_factory=Limits)
    puts: PutLimits = field(default_factory=PutLimits)
    # Shared secret every call must carry as "authorization: Bearer <secret>" metadata
    # (the health service excepted). None: no authentication (the embedded local setup).
    auth_token: str | None = field(default=None, repr=False)
    # A conversation's fence (lease incarnation and token counter) outlives its last
    # lease by this long, so a holder that lost its lease learns it was stale_fence;
    # after that the fence key expires (no key per conversation is kept forever).
    fence_retention_ms: int = 3_600_000
    health_interval_s: float = 0.5     # Redis liveness probe (and embedded restart) period
    # A prefix-index entry lives this long after the last announce of its name (any replica).
    prefix_ttl_s: float = 1800.0
    # A conversation (head, ledger, marks; its fence with it) expires this long after its last
    # turn (acquire, renew, publish, rewind, fork); 0 = never. OpenAI keeps stored responses 30 days.
    conversation_ttl_s: float = 30 * 86400.0
    # How often tier entries whose conversation is gone (expired) are dropped.
    tier_sweep_interval_s: float = 60.0
    # The embedded redis-server's maxmemory (0 = none); its policy is always noeviction: a
    # write refused for memory is STORAGE_FULL, never a lease or head evicted silently.
    redis_maxmemory_bytes: int = 1 << 30
    tier_placement: TierPlacement = TierPlacement.SINGLE
    # Calls gRPC has received but this process has not picked up yet. Past gRPC's own defaults
    # (1,000, then rejected at random up to 3,000) a burst is cancelled with a bare CANCELLED,
    # which a client cannot tell from a call cut mid-way (Interrupted, not retried): a router
    # opening thousands of sessions at once lost turns that way. Queued, they wait within
    # their deadlines instead.
    max_pending_rpcs: int = 65_536

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"bad port {self.port}")
        if self.redis_timeout_s <= 0 or self.grace_s < 0 or self.health_interval_s <= 0 \
                or self.prefix_ttl_s <= 0 or self.tier_sweep_interval_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_pending_rpcs < 1:
            raise ValueError("max_pending_rpcs must be >= 1")
        if self.conversation_ttl_s < 0 or self.redis_maxmemory_bytes < 0:
            raise ValueError("conversation_ttl_s and redis_maxmemory_bytes must be >= 0 (0: none)")
        if self.fence_retention_ms < self.limits.max_lease_ttl_ms:
            raise ValueError("fence_retention_ms must be at least limits.max_lease_ttl_ms")
        if 0 < self.conversation_ttl_ms < self.limits.min_ttl_ms:
            raise ValueError("conversation_ttl_s is under the shortest TTL (10 ms)")
        if sum(map(bool, (self.redis_url is not None, self.redis_sentinels, self.redis_cluster))) > 1:
            raise ValueError("give one of a Redis URL, sentinels or cluster nodes, not several")
        if self.redis_sentinels:
            SentinelTarget(self.redis_sentinels, self.redis_master_name)  # refuses a malformed address
        if self.redis_cluster:
            ClusterTarget(self.redis_cluster)
        if self.publish_wait_replicas < 0 or self.publish_wait_timeout_ms <= 0:
            raise ValueError("need publish_wait_replicas >= 0 and publish_wait_timeout_ms > 0")
        if self.auth_token is not None and len(self.auth_token) < 16:
            raise ValueError("auth_token must be at least 16 characters")

    @property
    def conversation_ttl_ms(self) -> int:
        return round(self.conversation_ttl_s * 1000)

    @property
    def redis_target(self) -> "str | SentinelTarget | ClusterTarget | None":
        """Where Redis is; None: start an embedded redis-server."""
        if self.redis_sentinels:
            return SentinelTarget(self.redis_sentinels, self.redis_master_name, self.redis_password)
        if self.redis_cluster:
            return ClusterTarget(self.redis_cluster, self.redis_password)
        return self.redis_url

    def fence_ttl_ms(self, lease_ttl_ms: int) -> int:
        """A fence outlives its lease by the retention, but not its conversation by more than
        the lease: an expired conversation takes its fence along."""
        ttl = self.conversation_ttl_ms
        return lease_ttl_ms + (min(self.fence_retention_ms, ttl) if ttl else self.fence_retention_ms)
