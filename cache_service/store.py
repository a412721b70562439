"""Metadata store: heads, leases and ledgers on Redis.

Thin by design: every mutation is one Lua script from scripts.py (atomic, one round
trip); this module packs arguments, unpacks replies into protobuf messages and maps
status words to typed errors. Input is assumed validated (validation.py).
"""

from __future__ import annotations

import secrets
import time

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from cache_service import errors, leases, scripts
from cache_service.keys import LEASE_KEY, ConversationKeys
from cache_service.prefix_store import PrefixIndexStore
from cache_service.leases import Fence
from cache_service.replica_wait import ReplicaWait, run_waited
from proto import cache_pb2 as pb

_LEASE_ERRORS = {
    b"LEASE_LOST": errors.LeaseLost,
    b"STALE_FENCE": errors.StaleFence,
}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _s(value: bytes | None) -> str:
    return value.decode() if value else ""


def _i(value: bytes | int | None) -> int:
    return int(value) if value else 0


def head_from_fields(fields: list) -> pb.Head:
    version, turn, tokens, sha, owner, tier, updated, incarnation = fields
    if not version:
        raise errors.NotFound("no such conversation (or wrong cache_salt)")
    return pb.Head(version=_i(version), turn=_i(turn), committed_tokens=_i(tokens),
                   tokens_sha256=_s(sha), owner_replica=_s(owner), tier_version=_i(tier),
                   updated_at_ms=_i(updated), incarnation=_s(incarnation))


def _raise_status(reply: list, what: str) -> None:
    status = reply[0]
    if status == b"OK":
        return
    if status in _LEASE_ERRORS:
        raise _LEASE_ERRORS[status](f"{what}: the lease is not the current lease of this conversation")
    if status == b"VERSION_CONFLICT":
        raise errors.VersionConflict(f"{what}: head version is {_i(reply[1])}",
                                     current_version=_i(reply[1]))
    if status == b"NOT_FOUND":
        raise errors.NotFound(f"{what}: not found")
    if status == b"ALREADY_EXISTS":
        raise errors.AlreadyExists(f"{what}: the target conversation already exists")
    if status == b"BAD_TURN":
        raise errors.InvalidArgument(f"{what}: turn is past the ledger's {_i(reply[1])} turns")
    if status == b"BAD_TOKEN_COUNT":
        raise errors.InvalidArgument(
            f"{what}: committed_tokens must be {_i(reply[1])} + len(turn.token_ids)")
    raise AssertionError(f"unknown script status {status!r}")


class MetadataStore:
    """`redis`: a client from redis_connect.connect. `conversation_ttl_ms`: a conversation's keys
    expire this long after its last turn (0: never). `wait`: the replicas that must acknowledge
    a ledger write before it is answered OK (replica_wait.py)."""

    def __init__(self, redis: aioredis.Redis, conversation_ttl_ms: int = 0, wait: ReplicaWait = ReplicaWait()):
        self._conversation_ttl_ms = conversation_ttl_ms
        self._wait = wait
        self._redis = redis
        r = self._redis
        self._acquire = r.register_script(scripts.ACQUIRE)
        self._renew = r.register_script(scripts.RENEW)
        self._release = r.register_script(scripts.RELEASE)
        self._publish = r.register_script(scripts.PUBLISH)
        self._discard = r.register_script(scripts.DISCARD)
        self._transfer = r.register_script(scripts.TRANSFER)
        self._rewind = r.register_script(scripts.REWIND)
        self._fork = r.register_script(scripts.FORK)
        self._fork_source = r.register_script(scripts.FORK_SOURCE)
        self._fork_target = r.register_script(scripts.FORK_TARGET)
        self._read_ledger = r.register_script(scripts.READ_LEDGER)
        self._mark_tier = r.register_script(scripts.MARK_TIER)
        self._delete = r.register_script(scripts.DELETE)
        self.prefixes = PrefixIndexStore(r)

    async def _ledger_write(self, script, keys: list, args: list, what: str):
        """A write that must survive a failover once answered: the ledger and head (publish,
        rewind, fork, transfer, delete) and the fence counter (acquire: a token handed out
        twice would let a stale holder's proof pass). Leases' TTLs, releases, discards and
        tier marks are not waited for: losing one only ends a lease early or costs a recompute."""
        return await run_waited(self._redis, script, keys, args, self._wait, what)

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()

    def _kept_ms(self, lease_ttl_ms: int = 0) -> str:
        """The TTL a write sets on a conversation's keys ('0': none); under a lease, past it."""
        ttl = self._conversation_ttl_ms
        return str(ttl + lease_ttl_ms) if ttl else "0"

    async def eviction_policy(self) -> str:
        reply = await self._redis.config_get("maxmemory-policy")
        value = reply.get("maxmemory-policy", reply.get(b"maxmemory-policy", b""))
        return value.decode() if isinstance(value, bytes) else value

    async def lease_key(self) -> bytes:
        """The lease-proof key: created by the first service on this Redis, then kept."""
        await self._redis.set(LEASE_KEY, secrets.token_bytes(leases.KEY_BYTES), nx=True)
        return await self._redis.get(LEASE_KEY)

    # -- leases -------------------------------------------------------------------

    async def acquire(self, keys: ConversationKeys, holder: str, ttl_ms: int, attempt: str,
                      fence_ttl_ms: int) -> tuple[int, str, int, pb.Head | None]:
        """(token, incarnation, expires_at_ms, head or None); LeaseHeld if busy."""
        start = now_ms()
        reply = await self._ledger_write(self._acquire, [keys.lease, keys.fence, keys.head, keys.ledger, keys.marks],
                                         [holder, ttl_ms, attempt, leases.new_incarnation(), fence_ttl_ms,
                                          self._kept_ms(ttl_ms)], "acquire")
        if reply[0] == b"LEASE_HELD":
            raise errors.LeaseHeld("conversation is busy: another turn holds its lease",
                                   expires_in_ms=_i(reply[1]))
        _raise_status(reply, "acquire")
        head = head_from_fields(reply[4]) if reply[4][0] else None
        return _i(reply[1]), _s(reply[2]), start + _i(reply[3]), head

    async def renew(self, keys: ConversationKeys, fence: Fence, ttl_ms: int,
                    fence_ttl_ms: int) -> pb.Lease:
        start = now_ms()
        reply = await self._renew(keys=[keys.lease, keys.fence, keys.head, keys.ledger, keys.marks],
                                  args=[fence.token, fence.incarnation, ttl_ms, fence_ttl_ms,
                                        self._kept_ms(ttl_ms)])
        _raise_status(reply, "renew")
        return pb.Lease(holder=_s(reply[1]), token=fence.token, expires_at_ms=start + ttl_ms)

    async def release(self, keys: ConversationKeys, fence: Fence) -> None:
        reply = await self._release(keys=[keys.lease], args=[fence.token, fence.incarnation])
        _raise_status(reply, "release")

    # -- heads and ledger ---------------------------------------------------------

    async def get_head(self, keys: ConversationKeys) -> pb.Head:
        return head_from_fields(await self._redis.hmget(keys.head, scripts.HEAD_FIELDS))

    async def publish(self, keys: ConversationKeys, req: pb.PublishTurnRequest, fence: Fence,
                      digest: str) -> pb.Head:
        # The turn number is the entry's position in the ledger list, so it is not
        # stored; read_ledger fills it in.
        entry = pb.LedgerTurn(messages=req.turn.messages, token_ids=req.turn.token_ids,
                              publish_id=req.publish_id, committed_at_ms=now_ms(),
                              result=req.turn.result)
        reply = await self._ledger_write(
            self._publish, [keys.head, keys.lease, keys.ledger, keys.marks],
            [fence.token, fence.incarnation, req.expected_version, entry.SerializeToString(),
             req.committed_tokens, req.tokens_sha256, req.owner_replica,
             entry.committed_at_ms, int(req.release_lease), req.publish_id,
             len(req.turn.token_ids), digest, leases.new_incarnation(), self._kept_ms()], "publish")
        _raise_status(reply, "publish")
        return head_from_fields(reply[1])

    async def discard(self, keys: ConversationKeys, fence: Fence) -> pb.Head | None:
        reply = await self._discard(keys=[keys.head, keys.lease], args=[fence.token, fence.incarnation])
        _raise_status(reply, "discard")
        return head_from_fields(reply[1]) if reply[1][0] else None

    async def transfer(self, keys: ConversationKeys, fence: Fence, expected_version: int,
                       new_owner: str) -> pb.Head:
        reply = await self._ledger_write(self._transfer, [keys.head, keys.lease],
                                         [fence.token, fence.incarnation, expected_version, new_owner, now_ms()],
                                         "transfer")
        _raise_status(reply, "transfer")
        return head_from_fields(reply[1])

    async def rewind(self, keys: ConversationKeys, fence: Fence, expected_version: int,
                     turn: int, owner: str) -> pb.Head:
        reply = await self._ledger_write(self._rewind, [keys.head, keys.lease, keys.ledger, keys.marks],
                                         [fence.token, fence.incarnation, expected_version, turn, owner, now_ms(),
                                          scripts.EMPTY_TOKENS_SHA256, self._kept_ms()], "rewind")
        _raise_status(reply, "rewind")
        return head_from_fields(reply[1])

    async def fork(self, source: ConversationKeys, target: ConversationKeys, turn: int,
                   expected_version: int) -> pb.Head:
        if isinstance(self._redis, RedisCluster) and \
                self._redis.keyslot(source.head) != self._redis.keyslot(target.head):
            return await self._fork_across_slots(source, target, turn, expected_version)
        reply = await self._ledger_write(
            self._fork, [source.head, source.ledger, source.marks, target.head, target.ledger, target.marks],
            [turn, expected_version, now_ms(), leases.new_incarnation(), scripts.EMPTY_TOKENS_SHA256,
             self._kept_ms()], "fork")
        _raise_status(reply, "fork")
        return head_from_fields(reply[1])

    async def _fork_across_slots(self, source: ConversationKeys, target: ConversationKeys, turn: int,
                                 expected_version: int) -> pb.Head:
        """A fork on a Redis Cluster: read the source, then write the target (scripts.FORK_SOURCE)."""
        read = await self._fork_source(keys=[source.head, source.ledger, source.marks], args=[turn, expected_version])
        _raise_status(read, "fork")
        _, committed, sha, entries, marks = read
        reply = await self._ledger_write(
            self._fork_target, [target.head, target.ledger, target.marks],
            [now_ms(), leases.new_incarnation(), self._kept_ms(), turn, committed,
             sha or scripts.EMPTY_TOKENS_SHA256, *entries, *marks], "fork")
        _raise_status(reply, "fork")
        return head_from_fields(reply[1])

    async def mark_tier(self, keys: ConversationKeys, version: int, incarnation: str,
                        fence: Fence | None) -> pb.Head:
        lease = [fence.token, fence.incarnation] if fence else ["", ""]
        reply = await self._mark_tier(keys=[keys.head, keys.lease],
                                      args=[version, incarnation, now_ms(), *lease])
        _raise_status(reply, "put state")
        return head_from_fields(reply[1])

    async def read_ledger(self, keys: ConversationKeys, from_turn: int, max_turns: int,
                          page_bytes: int) -> tuple[pb.Head, list[pb.LedgerTurn], int]:
        """(head, turns, next turn or 0): one page, bounded by turns and by bytes."""
        first = max(from_turn, 1)
        fields, nxt, entries = await self._read_ledger(
            keys=[keys.head, keys.ledger, keys.marks], args=[first - 1, max_turns, page_bytes])
        head = head_from_fields(fields)
        turns = []
        for offset, raw in enumerate(entries):
            turn = pb.LedgerTurn.FromString(raw)
            turn.turn = first + offset
            turns.append(turn)
        return head, turns, _i(nxt)

    async def heads_exist(self, conv_hashes: list[str]) -> list[bool]:
        """Whether each conversation still has a head (one round trip; pure reads)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for conv in conv_hashes:
                pipe.exists(ConversationKeys(conv).head)
            return [bool(n) for n in await pipe.execute()]

    async def delete(self, keys: ConversationKeys) -> bool:
        # The fence goes too: a re-created conversation starts a new incarnation, so
        # no proof of an old holder matches any later lease.
        return await self._ledger_write(self._delete, [keys.fence, keys.head, keys.lease, keys.ledger, keys.marks],
                                        [], "delete") > 0
