"""The real parts of a point: one embedded Redis, N `python -m cache_service` instances on it
(rendezvous tier placement, as several instances must run), the population seeded, and the
counters read before and after the measured window (Redis INFO, each process's CPU time).

Seeding writes each conversation's first turn with the service's own two Lua scripts (acquire,
publish) straight into Redis, pipelined: 100k conversations through gRPC would take minutes of the
point's budget, and the rows are the ones the service writes (same scripts, same arguments as
bench/cache_service.py's raw-Redis floor).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from cache_service import scripts
from cache_service.config import FsyncPolicy, ServerConfig
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from cache_service.keys import ConversationKeys
from cache_service.launch import CacheServiceChild
from cache_service.leases import new_incarnation
from cache_service.store import now_ms
from proto import cache_pb2 as pb
from proto.contract import ConversationRef, tokens_digest

SALT = "scale"
SEED_TOKENS = list(range(16))
SEED_BATCH = 2000
CONVERSATION_TTL_MS = int(ServerConfig.conversation_ttl_s * 1000)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def conversation(i: int) -> ConversationRef:
    return ConversationRef(f"conv-{i}", SALT)


@dataclass
class Deployment:
    redis: EmbeddedRedis
    instances: list[CacheServiceChild]

    @property
    def target(self) -> str:
        return ",".join(f"127.0.0.1:{child.port}" for child in self.instances)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time used so far: Redis's own count, and each instance process's from /proc."""
        info = redis.Redis.from_url(self.redis.url).info("cpu")
        out = {"redis": info["used_cpu_user"] + info["used_cpu_sys"]}
        for i, child in enumerate(self.instances):
            fields = Path(f"/proc/{child.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[f"instance{i}"] = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
        return out


@contextmanager
def deployed(workdir: Path, instances: int, state_budget: int):
    """Redis (AOF, appendfsync everysec as bench/cache_service.py) and `instances` services on it."""
    with ExitStack() as stack:
        server = stack.enter_context(EmbeddedRedis(EmbeddedRedisConfig(
            data_dir=workdir / "redis", fsync=FsyncPolicy.EVERYSEC, maxmemory_bytes=8 << 30)))
        children = []
        for i in range(instances):
            child = CacheServiceChild(["--port", "0", "--data-dir", str(workdir / f"svc{i}"),
                                       "--tier-budget", str(state_budget), "--tier-placement", "rendezvous",
                                       "--log-level", "INFO"], redis_url=server.url, die_with_parent=True)
            child.start()
            stack.callback(child.stop, 30)
            children.append(child)
        yield Deployment(server, children)


def seed(url: str, conversations: int) -> None:
    """Stores conversations 0..n-1 with one short turn each, released, owned by nobody."""
    r = redis.Redis.from_url(url)
    acquire, publish = r.register_script(scripts.ACQUIRE), r.register_script(scripts.PUBLISH)
    entry = pb.LedgerTurn(messages=[pb.Message(role="user", content="hello")], token_ids=SEED_TOKENS)
    sha = tokens_digest(SEED_TOKENS)
    for start in range(0, conversations, SEED_BATCH):
        batch = [ConversationKeys.of(conversation(i)) for i in range(start, min(conversations, start + SEED_BATCH))]
        attempts = [hashlib.sha256(os.urandom(16)).hexdigest() for _ in batch]
        pipe = r.pipeline(transaction=False)
        for keys, attempt in zip(batch, attempts):
            acquire(keys=[keys.lease, keys.fence, keys.head, keys.ledger, keys.marks],
                    args=["seed", 30_000, attempt, new_incarnation(), 30_000 + 3_600_000,
                          str(CONVERSATION_TTL_MS + 30_000)], client=pipe)
        replies = pipe.execute()
        pipe = r.pipeline(transaction=False)
        for keys, attempt, reply in zip(batch, attempts, replies):
            publish_id = uuid.uuid4().hex
            turn = pb.LedgerTurn(messages=entry.messages, token_ids=entry.token_ids, publish_id=publish_id,
                                 committed_at_ms=now_ms())
            publish(keys=[keys.head, keys.lease, keys.ledger, keys.marks],
                    args=[reply[1], reply[2], 0, turn.SerializeToString(), len(SEED_TOKENS), sha, "",
                          turn.committed_at_ms, 1, publish_id, len(SEED_TOKENS), attempt, new_incarnation(),
                          str(CONVERSATION_TTL_MS)], client=pipe)
        for reply in pipe.execute():
            assert reply[0] == b"OK", reply
    r.close()


def redis_counters(url: str) -> dict:
    """Commands (all, and per command: scripts' inner calls included) and bytes on the wire so far."""
    r = redis.Redis.from_url(url)
    stats, commands, memory = r.info("stats"), r.info("commandstats"), r.info("memory")
    r.close()
    return {"commands": sum(c["calls"] for c in commands.values()),
            "by_command": {name.removeprefix("cmdstat_"): c["calls"] for name, c in commands.items()},
            "net_in_bytes": stats["total_net_input_bytes"], "net_out_bytes": stats["total_net_output_bytes"],
            "used_memory": memory["used_memory"]}


def ledger_turns(url: str, conversations: list[int]) -> int:
    """Turns in the ledgers of these conversations (what Redis says was published)."""
    r = redis.Redis.from_url(url)
    total = 0
    for start in range(0, len(conversations), SEED_BATCH):
        pipe = r.pipeline(transaction=False)
        for i in conversations[start:start + SEED_BATCH]:
            pipe.llen(ConversationKeys.of(conversation(i)).ledger)
        total += sum(pipe.execute())
    r.close()
    return total
