"""Async client of the cache service, for the router and the workers.

    async with CacheClient("127.0.0.1:50051") as cache:
        conv = Conversation("c-42", salt="user-7")
        lease = await cache.acquire_lease(conv, ttl_ms=30_000, wait_s=2.0)
        head = await cache.get_head_or_none(conv)
        ...
        await cache.publish_turn(conv, lease_token=lease.token, expected_version=v, ...)

Every call has a deadline and retries UNAVAILABLE with jittered exponential backoff.
Retrying is safe because every mutation is idempotent on the server: an acquire is
keyed by its holder (fixed for all attempts of one call), a publish by its publish_id.
Failures surface as the typed exceptions of cache_service.errors (re-exported here).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from cache_service import hashing
from cache_service.errors import (  # noqa: F401
    CacheError,
    DataLoss,
    DeadlineExceeded,
    InvalidArgument,
    LeaseHeld,
    LeaseLost,
    MissingChunks,
    NotFound,
    StaleFence,
    Unavailable,
    VersionConflict,
    from_status,
)
from proto import cache_pb2 as pb
from proto import cache_pb2_grpc

tokens_sha256 = hashing.tokens_sha256


@dataclass(frozen=True)
class Conversation:
    """A conversation's identity: (conversation_id, cache_salt)."""

    id: str
    salt: str = ""

    def pb(self) -> pb.ConversationKey:
        return pb.ConversationKey(conversation_id=self.id, cache_salt=self.salt)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 10
    initial_backoff_s: float = 0.02
    max_backoff_s: float = 1.0
    multiplier: float = 2.0

    def backoff(self, attempt: int) -> float:
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** attempt)
        return random.uniform(cap / 2, cap)  # jitter: retrying clients spread out


@dataclass(frozen=True)
class ClientConfig:
    timeout_s: float = 5.0             # deadline of each unary attempt
    stream_timeout_s: float = 300.0    # deadline of each state put/get attempt
    chunk_bytes: int = 1 << 20         # chunk size when put_state gets one bytes object
    holder_prefix: str = "client"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_message_bytes: int = 64 << 20


def _messages(messages: Sequence[pb.Message | Mapping[str, Any]]) -> list[pb.Message]:
    out = []
    for m in messages:
        if isinstance(m, pb.Message):
            out.append(m)
        else:
            content = m["content"]
            out.append(pb.Message(role=m["role"], content=content if isinstance(content, str)
                                  else json.dumps(content, separators=(",", ":"))))
    return out


class CacheClient:
    def __init__(self, target: str, config: ClientConfig | None = None):
        self.config = config or ClientConfig()
        self.target = target
        size = self.config.max_message_bytes
        self._channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            # Reconnect quickly after a service restart (gRPC's default starts at 1 s
            # and grows to 120 s, far longer than a restart takes).
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])
        self._stub = cache_pb2_grpc.CacheServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "CacheClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        await asyncio.wait_for(self._channel.channel_ready(), timeout_s)

    # -- the retry loop -------------------------------------------------------------

    async def _retrying(self, attempt_fn: Callable[[], Any]) -> Any:
        policy = self.config.retry
        for attempt in range(policy.attempts):
            try:
                return await attempt_fn()
            except grpc.aio.AioRpcError as exc:
                error = from_status(exc.code(), exc.details() or "", exc.trailing_metadata())
                if error is None:
                    raise
                if not isinstance(error, Unavailable) or attempt == policy.attempts - 1:
                    raise error from exc
            await asyncio.sleep(policy.backoff(attempt))
        raise AssertionError("unreachable")

    async def _unary(self, method: str, request) -> Any:
        rpc = getattr(self._stub, method)
        return await self._retrying(lambda: rpc(request, timeout=self.config.timeout_s))

    # -- replicas ---------------------------------------------------------------------

    async def register_replica(self, replica_id: str, address: str, ttl_ms: int) -> pb.Replica:
        reply = await self._unary("RegisterReplica", pb.RegisterReplicaRequest(
            replica_id=replica_id, address=address, ttl_ms=ttl_ms))
        return reply.replica

    async def heartbeat(self, replica_id: str, epoch: int, ttl_ms: int, *,
                        running_requests: int = 0, free_kv_blocks: int = 0) -> pb.Replica:
        """NotFound means the registration expired or was superseded: register again."""
        reply = await self._unary("Heartbeat", pb.HeartbeatRequest(
            replica_id=replica_id, epoch=epoch, ttl_ms=ttl_ms,
            running_requests=running_requests, free_kv_blocks=free_kv_blocks))
        return reply.replica

    async def list_replicas(self) -> list[pb.Replica]:
        return list((await self._unary("ListReplicas", pb.ListReplicasRequest())).replicas)

    # -- leases -----------------------------------------------------------------------

    async def acquire_lease(self, conv: Conversation, ttl_ms: int, *, holder: str | None = None,
                            wait_s: float = 0.0) -> pb.Lease:
        """Take the conversation's lease; LeaseHeld if busy for longer than wait_s."""
        request = pb.AcquireLeaseRequest(
            key=conv.pb(), ttl_ms=ttl_ms,
            holder=holder or f"{self.config.holder_prefix}:{uuid.uuid4().hex}")
        give_up = time.monotonic() + wait_s
        attempt = 0
        while True:
            try:
                return await self._unary("AcquireLease", request)
            except LeaseHeld:
                if time.monotonic() >= give_up:
                    raise
            await asyncio.sleep(min(self.config.retry.backoff(attempt), max(give_up - time.monotonic(), 0)))
            attempt += 1

    async def renew_lease(self, conv: Conversation, token: int, ttl_ms: int) -> pb.Lease:
        return await self._unary("RenewLease", pb.RenewLeaseRequest(key=conv.pb(), token=token, ttl_ms=ttl_ms))

    async def release_lease(self, conv: Conversation, token: int) -> None:
        await self._unary("ReleaseLease", pb.ReleaseLeaseRequest(key=conv.pb(), token=token))

    # -- heads and ledger -------------------------------------------------------------

    async def get_head(self, conv: Conversation) -> pb.Head:
        """NotFound when the conversation has no head (or the salt is wrong)."""
        return await self._unary("GetHead", pb.GetHeadRequest(key=conv.pb()))

    async def get_head_or_none(self, conv: Conversation) -> pb.Head | None:
        try:
            return await self.get_head(conv)
        except NotFound:
            return None

    async def publish_turn(self, conv: Conversation, *, lease_token: int, expected_version: int,
                           messages: Sequence[pb.Message | Mapping[str, Any]],
                           token_ids: Sequence[int], committed_tokens: int, tokens_sha256: str,
                           owner_replica: str = "", release_lease: bool = True,
                           publish_id: str | None = None) -> pb.Head:
        """Commit a turn: CAS on expected_version, fenced by lease_token.

        token_ids are this turn's new tokens (suffix prompt + generated); the server
        checks committed_tokens == previous committed_tokens + len(token_ids).
        """
        request = pb.PublishTurnRequest(
            key=conv.pb(), lease_token=lease_token, expected_version=expected_version,
            turn=pb.LedgerTurn(messages=_messages(messages), token_ids=token_ids),
            committed_tokens=committed_tokens, tokens_sha256=tokens_sha256,
            owner_replica=owner_replica, release_lease=release_lease,
            publish_id=publish_id or uuid.uuid4().hex)
        return await self._unary("PublishTurn", request)

    async def discard(self, conv: Conversation, lease_token: int) -> pb.Head:
        """Give up a turn: release the lease, keep the head. A lease already lost is
        not an error here (the head is unchanged either way); returns the head
        (version 0 if the conversation has none)."""
        try:
            return await self._unary("Discard", pb.DiscardRequest(key=conv.pb(), lease_token=lease_token))
        except LeaseLost:
            return await self.get_head_or_none(conv) or pb.Head()

    async def read_ledger(self, conv: Conversation, *, from_turn: int = 1,
                          max_turns: int = 0) -> pb.ReadLedgerResponse:
        return await self._unary("ReadLedger", pb.ReadLedgerRequest(
            key=conv.pb(), from_turn=from_turn, max_turns=max_turns))

    async def delete_conversation(self, conv: Conversation) -> bool:
        reply = await self._unary("DeleteConversation", pb.DeleteConversationRequest(key=conv.pb()))
        return reply.existed

    async def transfer_ownership(self, conv: Conversation, *, lease_token: int,
                                 expected_version: int, new_owner: str) -> pb.Head:
        return await self._unary("TransferOwnership", pb.TransferOwnershipRequest(
            key=conv.pb(), lease_token=lease_token, expected_version=expected_version,
            new_owner=new_owner))

    async def stats(self) -> pb.Stats:
        return await self._unary("GetStats", pb.GetStatsRequest())

    # -- state tier -------------------------------------------------------------------

    async def put_state(self, conv: Conversation, version: int,
                        data: bytes | Sequence[bytes]) -> pb.PutStateResponse:
        """Export the state of head `version`. Only chunks the tier lacks travel.

        Pass a sequence of chunks to choose the boundaries (e.g. one per KV block
        group, so unchanged blocks hash the same from one export to the next); a
        single bytes object is cut into config.chunk_bytes pieces.
        """
        chunks = hashing.split(data, self.config.chunk_bytes) if isinstance(data, (bytes, bytearray, memoryview)) \
            else list(data)
        digests = await asyncio.to_thread(lambda: [hashing.sha256(c) for c in chunks])
        manifest = pb.StateManifest(key=conv.pb(), version=version, chunks=[
            pb.ChunkRef(digest=d, size=len(c)) for d, c in zip(digests, chunks, strict=True)])
        missing = await self._unary("MissingChunks", pb.MissingChunksRequest(
            key=conv.pb(), digests=list(dict.fromkeys(digests))))
        try:
            return await self._put_stream(manifest, chunks, digests, set(missing.digests))
        except MissingChunks:
            # Chunks the tier held a moment ago were superseded meanwhile: send all.
            return await self._put_stream(manifest, chunks, digests, set(digests))

    async def _put_stream(self, manifest: pb.StateManifest, chunks: Sequence[bytes],
                          digests: Sequence[bytes], send: set[bytes]) -> pb.PutStateResponse:
        async def requests() -> AsyncIterator[pb.PutStateRequest]:
            yield pb.PutStateRequest(manifest=manifest)
            pending = set(send)
            for digest, chunk in zip(digests, chunks, strict=True):
                if digest in pending:
                    pending.discard(digest)
                    yield pb.PutStateRequest(chunk=pb.Chunk(digest=digest, data=bytes(chunk)))

        return await self._retrying(
            lambda: self._stub.PutState(requests(), timeout=self.config.stream_timeout_s))

    async def get_state(self, conv: Conversation, version: int = 0) -> tuple[int, bytes]:
        """Import a head's state: (version, bytes), every chunk verified end to end."""
        async def attempt() -> tuple[int, bytes]:
            call = self._stub.GetState(pb.GetStateRequest(key=conv.pb(), version=version),
                                       timeout=self.config.stream_timeout_s)
            manifest, parts = None, []
            async for reply in call:
                if reply.HasField("manifest"):
                    manifest = reply.manifest
                    continue
                ref = manifest.chunks[len(parts)]
                if reply.chunk.digest != ref.digest or \
                        await asyncio.to_thread(hashing.sha256, reply.chunk.data) != ref.digest:
                    raise DataLoss(f"state chunk #{len(parts)} arrived corrupted")
                parts.append(reply.chunk.data)
            if manifest is None or len(parts) != len(manifest.chunks):
                raise DataLoss("state stream ended early")
            return manifest.version, b"".join(parts)

        return await self._retrying(attempt)
