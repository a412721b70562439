"""Metadata store: heads, leases, ledgers and the replica registry on Redis.

Thin by design: every mutation is one Lua script from scripts.py (atomic, one round
trip); this module packs arguments, unpacks replies into protobuf messages and maps
status words to typed errors. Input is assumed validated (validation.py).
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from cache_service import errors, scripts
from cache_service.keys import REPLICA_EPOCH, REPLICA_SET, ConversationKeys, replica_key
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
    version, turn, tokens, sha, owner, tier, updated = fields
    if not version:
        raise errors.NotFound("no such conversation (or wrong cache_salt)")
    return pb.Head(version=_i(version), turn=_i(turn), committed_tokens=_i(tokens),
                   tokens_sha256=_s(sha), owner_replica=_s(owner), tier_version=_i(tier),
                   updated_at_ms=_i(updated))


def _raise_status(reply: list, what: str) -> None:
    status = reply[0]
    if status == b"OK":
        return
    if status in _LEASE_ERRORS:
        raise _LEASE_ERRORS[status](f"{what}: the lease token is not the current lease")
    if status == b"VERSION_CONFLICT":
        raise errors.VersionConflict(f"{what}: head version is {_i(reply[1])}",
                                     current_version=_i(reply[1]))
    if status == b"NOT_FOUND":
        raise errors.NotFound(f"{what}: not found")
    if status == b"BAD_TOKEN_COUNT":
        raise errors.InvalidArgument(
            f"{what}: committed_tokens must be {_i(reply[1])} + len(turn.token_ids)")
    raise AssertionError(f"unknown script status {status!r}")


class MetadataStore:
    def __init__(self, url: str, timeout_s: float):
        # Few, fast retries: the service answers UNAVAILABLE soon and lets the client
        # back off; a long stall here would only eat the caller's deadline.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 2),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            max_connections=256)
        r = self._redis
        self._acquire = r.register_script(scripts.ACQUIRE)
        self._renew = r.register_script(scripts.RENEW)
        self._release = r.register_script(scripts.RELEASE)
        self._publish = r.register_script(scripts.PUBLISH)
        self._discard = r.register_script(scripts.DISCARD)
        self._transfer = r.register_script(scripts.TRANSFER)
        self._mark_tier = r.register_script(scripts.MARK_TIER)
        self._register = r.register_script(scripts.REGISTER)
        self._heartbeat = r.register_script(scripts.HEARTBEAT)
        self._list_replicas = r.register_script(scripts.LIST_REPLICAS)

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()

    # -- leases -------------------------------------------------------------------

    async def acquire(self, keys: ConversationKeys, holder: str, ttl_ms: int) -> pb.Lease:
        start = now_ms()
        reply = await self._acquire(keys=[keys.lease, keys.fence], args=[holder, ttl_ms])
        if reply[0] == b"LEASE_HELD":
            raise errors.LeaseHeld("conversation is busy: another turn holds its lease",
                                   holder=_s(reply[1]), expires_in_ms=_i(reply[2]))
        _raise_status(reply, "acquire")
        return pb.Lease(holder=holder, token=_i(reply[1]), expires_at_ms=start + _i(reply[2]))

    async def renew(self, keys: ConversationKeys, token: int, ttl_ms: int) -> pb.Lease:
        start = now_ms()
        reply = await self._renew(keys=[keys.lease], args=[token, ttl_ms])
        _raise_status(reply, "renew")
        return pb.Lease(holder=_s(reply[1]), token=token, expires_at_ms=start + ttl_ms)

    async def release(self, keys: ConversationKeys, token: int) -> None:
        _raise_status(await self._release(keys=[keys.lease], args=[token]), "release")

    # -- heads and ledger ---------------------------------------------------------

    async def get_head(self, keys: ConversationKeys) -> pb.Head:
        return head_from_fields(await self._redis.hmget(keys.head, scripts.HEAD_FIELDS))

    async def publish(self, keys: ConversationKeys, req: pb.PublishTurnRequest) -> pb.Head:
        # The turn number is the entry's position in the ledger list, so it is not
        # stored; read_ledger fills it in.
        entry = pb.LedgerTurn(messages=req.turn.messages, token_ids=req.turn.token_ids,
                              publish_id=req.publish_id, committed_at_ms=now_ms())
        reply = await self._publish(
            keys=[keys.head, keys.lease, keys.ledger],
            args=[req.lease_token, req.expected_version, entry.SerializeToString(),
                  req.committed_tokens, req.tokens_sha256, req.owner_replica,
                  entry.committed_at_ms, int(req.release_lease), req.publish_id,
                  len(req.turn.token_ids)])
        _raise_status(reply, "publish")
        return head_from_fields(reply[1])

    async def discard(self, keys: ConversationKeys, token: int) -> pb.Head | None:
        reply = await self._discard(keys=[keys.head, keys.lease], args=[token])
        _raise_status(reply, "discard")
        return head_from_fields(reply[1]) if reply[1][0] else None

    async def transfer(self, keys: ConversationKeys, token: int, expected_version: int,
                       new_owner: str) -> pb.Head:
        reply = await self._transfer(keys=[keys.head, keys.lease],
                                     args=[token, expected_version, new_owner, now_ms()])
        _raise_status(reply, "transfer")
        return head_from_fields(reply[1])

    async def mark_tier(self, keys: ConversationKeys, version: int) -> pb.Head:
        reply = await self._mark_tier(keys=[keys.head], args=[version, now_ms()])
        _raise_status(reply, "put state")
        return head_from_fields(reply[1])

    async def read_ledger(self, keys: ConversationKeys, from_turn: int,
                          max_turns: int) -> tuple[pb.Head, list[pb.LedgerTurn]]:
        first = max(from_turn, 1)
        last = -1 if max_turns == 0 else first + max_turns - 2
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hmget(keys.head, scripts.HEAD_FIELDS)
            pipe.lrange(keys.ledger, first - 1, last)
            fields, entries = await pipe.execute()
        head = head_from_fields(fields)
        turns = []
        for offset, raw in enumerate(entries):
            turn = pb.LedgerTurn.FromString(raw)
            turn.turn = first + offset
            turns.append(turn)
        return head, turns

    async def delete(self, keys: ConversationKeys) -> bool:
        # The fence counter stays: a re-created conversation must never hand out a
        # token an old, stale holder still carries.
        return await self._redis.delete(keys.head, keys.ledger, keys.lease) > 0

    # -- replicas -----------------------------------------------------------------

    async def register_replica(self, replica_id: str, address: str, ttl_ms: int) -> pb.Replica:
        now = now_ms()
        reply = await self._register(keys=[replica_key(replica_id), REPLICA_EPOCH, REPLICA_SET],
                                     args=[replica_id, address, ttl_ms, now])
        return pb.Replica(replica_id=replica_id, address=address, epoch=_i(reply[1]),
                          last_seen_ms=now)

    async def heartbeat(self, req: pb.HeartbeatRequest) -> pb.Replica:
        reply = await self._heartbeat(
            keys=[replica_key(req.replica_id)],
            args=[req.epoch, req.ttl_ms, now_ms(), req.running_requests, req.free_kv_blocks])
        if reply[0] == b"NOT_FOUND":
            raise errors.NotFound(f"replica {req.replica_id!r} epoch {req.epoch} is not "
                                  "registered (expired or superseded): register again")
        return _replica(reply[1])

    async def list_replicas(self) -> list[pb.Replica]:
        rows = await self._list_replicas(keys=[REPLICA_SET], args=[replica_key("")])
        return sorted((_replica(row) for row in rows), key=lambda r: r.replica_id)


def _replica(fields: list) -> pb.Replica:
    rid, address, epoch, running, free, seen = fields
    return pb.Replica(replica_id=_s(rid), address=_s(address), epoch=_i(epoch),
                      running_requests=_i(running), free_kv_blocks=_i(free),
                      last_seen_ms=_i(seen))
