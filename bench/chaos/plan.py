"""What a chaos run does (ChaosPlan: its clients and faults) and what it saw (Report)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


class Fault(str, Enum):
    DISCONNECT = "client disconnect mid-stream"
    DUPLICATE = "concurrent duplicate retry"
    KILL_WORKER = "worker SIGKILL"
    RESTART_SERVICE = "cache-service restart"
    PAUSE_REDIS = "Redis SIGSTOP/SIGCONT"
    SLOW_SERVICE = "cache-service SIGSTOP/SIGCONT (under the lease TTL)"
    TTL_EXPIRY = "conversation idle past its TTL"
    TIER_SPILL = "state-tier spill to disk"


# The faults the injector causes (the others come from clients, or from the tier's small budget).
INFRA_FAULTS = (Fault.KILL_WORKER, Fault.RESTART_SERVICE, Fault.PAUSE_REDIS, Fault.SLOW_SERVICE)


class ClientKind(str, Enum):
    CHAT = "chat conversation (conversation_id)"
    RESPONSES = "Responses API chain (previous_response_id, forks, DELETE)"
    STATELESS = "stateless chat (the whole history each turn)"


class Infrastructure(Protocol):
    """The faults a stack can suffer; each returns once the fault is over (the process restarted
    or resumed), not once the system recovered from it."""

    async def kill_worker(self, replica_id: str) -> bool:
        """False if that replica was gone already."""

    async def restart_service(self) -> None: ...

    async def pause_redis(self, seconds: float) -> None: ...

    async def pause_service(self, seconds: float) -> None: ...

    async def tier_spills(self) -> int:
        """Spills of the state tier to disk since the run began (across service restarts)."""

    async def settled(self) -> None:
        """Every replica runs again (a killed one was replaced)."""


@dataclass(frozen=True)
class ChaosPlan:
    conversations: int = 8
    turns: int = 4
    max_tokens: int = 8
    seed: int = 0
    # Client i is kinds[i % len(kinds)].
    kinds: tuple[ClientKind, ...] = (ClientKind.CHAT, ClientKind.RESPONSES, ClientKind.CHAT, ClientKind.STATELESS)
    disconnect_rate: float = 0.15  # of attempts: hang up after the first streamed token
    duplicate_rate: float = 0.15   # of attempts: the same attempt sent twice at once
    stop_rate: float = 0.2         # of chat turns: with a stop string (the reply may be cut at it)
    replay_rate: float = 0.3       # of committed turns besides those cut or stopped: replayed by key
    fork_rate: float = 0.15        # of Responses turns: from an older response (a fork)
    delete_rate: float = 0.1       # of Responses turns: DELETE the latest response first
    expiry_rate: float = 0.05      # of turns after a conversation's first: idle past the TTL first
    conversation_ttl_s: float = 20.0  # the stack's retention (0: none, and no TTL_EXPIRY faults)
    lease_ttl_s: float = 10.0      # the app's; a lease keeps its conversation this much past the TTL
    infra_faults: tuple[Fault, ...] = INFRA_FAULTS
    infra_every_turns: int = 7     # an infrastructure fault after about every this many committed turns
    redis_pause_s: float = 12.0    # longer than the cache client's per-call deadline
    service_pause_s: float = 3.0   # under the lease TTL: slow, not gone
    max_attempts: int = 60
    budget_s: float = 600.0

    def as_dict(self) -> dict:
        plan = dict(self.__dict__)
        plan["kinds"] = [k.name.lower() for k in self.kinds]
        plan["infra_faults"] = [f.value for f in self.infra_faults]
        return plan


@dataclass
class Report:
    attempts: int = 0
    committed: int = 0
    failed_and_told: int = 0
    committed_by_kind: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    replays: int = 0      # Idempotency-Key replays compared with the live answer
    forks: int = 0
    deletes: int = 0
    expiries: int = 0     # conversations seen expired (each a clean 404, then a new one)
    divergences: list[str] = field(default_factory=list)
    errors_seen: Counter = field(default_factory=Counter)
    wall_s: float = 0.0

    @property
    def faults_total(self) -> int:
        """Faults injected, one per event: a spill moves one chunk, and many happen at once, so
        spills are counted apart (they show the tier was spilling while the clients ran)."""
        return sum(n for f, n in self.faults.items() if f is not Fault.TIER_SPILL)

    def as_dict(self) -> dict:
        return {"attempts": self.attempts, "committed": self.committed, "failed_and_told": self.failed_and_told,
                "committed_by_kind": {k.name.lower(): n for k, n in self.committed_by_kind.items()},
                "faults": {f.value: n for f, n in self.faults.items()}, "faults_total": self.faults_total,
                "replays_compared": self.replays, "forks": self.forks, "deletes": self.deletes,
                "expiries_seen": self.expiries, "divergences": self.divergences,
                "errors_seen": dict(self.errors_seen), "wall_s": self.wall_s}
