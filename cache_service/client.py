"""Async client of the cache service, for the router and the workers.

    async with CacheClient("127.0.0.1:50051") as cache:
        conv = ConversationRef("c-42", salt="user-7")
        lease = await cache.acquire_lease(conv, ttl_ms=30_000, wait_s=2.0)
        head = lease.head                      # version 0: a new conversation
        ...
        await cache.publish_turn(conv, lease_token=lease, expected_version=head.version, ...)

Every call has a deadline and retries UNAVAILABLE with jittered exponential backoff.
Retrying is safe because every mutation is idempotent on the server: an acquire is
keyed by its holder and a random attempt key (fixed for all attempts of one call), a
publish by its publish_id (plus its content and lease).
Failures surface as the typed exceptions of cache_service.errors (re-exported here).

Lease proofs: a lease is its token plus an opaque proof (see leases.py). Fenced calls
take `lease_token=` either the Lease returned by acquire_lease (it carries the proof)
or the bare token number, in which case this client supplies the proof it remembers
from its own acquire_lease; a different client instance must be given the Lease (or
`lease_proof=`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from cache_service import hashing, state_chunks
from cache_service.errors import (  # noqa: F401 (the client's face: callers catch these from here)
    AlreadyExists, CacheError, DataLoss, DeadlineExceeded, Interrupted, InvalidArgument, LeaseHeld, LeaseLost,
    MissingChunks, NotFound, ResourceExhausted, StaleFence, StorageFull, Unauthenticated, Unavailable,
    VersionConflict, from_status,
)
from cache_service.client_config import SERVICE_LIMITS, ClientConfig, RetryPolicy  # noqa: F401 (the client's face)
from cache_service.wire import bearer
from proto import cache_pb2 as pb
from proto import cache_pb2_grpc
from proto.contract import ConversationRef

TurnResult = pb.TurnResult  # what a committed turn answered (publish_turn(result=...))
SentReply, SentToolCall = pb.SentReply, pb.SentToolCall  # its reply as the client was sent it

def key_message(conv: ConversationRef) -> pb.ConversationKey:
    """The conversation as the wire names it: its id and salt, never its key (the service hashes)."""
    return pb.ConversationKey(conversation_id=conv.id, cache_salt=conv.salt)


LeaseArg = int | pb.Lease


@dataclass(frozen=True)
class PrefixMatch:
    """Who holds a chat's prefixes: `index` into the names asked for (entry k names
    messages[:k + 1]) of the longest any replica holds, and every holder as (replica, tokens of
    its longest)."""

    index: int
    holders: tuple[tuple[str, int], ...]


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
        self._metadata = bearer(self.config.auth_token) if self.config.auth_token else None
        self._proofs: OrderedDict[tuple[ConversationRef, int], bytes] = OrderedDict()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "CacheClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        await asyncio.wait_for(self._channel.channel_ready(), timeout_s)

    # -- the retry loop -------------------------------------------------------------

    async def _retrying(self, attempt_fn: Callable[[], Any], *, stream: bool = False) -> Any:
        """Retry UNAVAILABLE. For the (idempotent) state streams also INTERNAL without
        an hs-reason: what a stream cut by a service crash looks like."""
        policy = self.config.retry
        for attempt in range(policy.attempts):
            try:
                return await attempt_fn()
            except grpc.aio.AioRpcError as exc:
                error = from_status(exc.code(), exc.details() or "", exc.trailing_metadata())
                if isinstance(error, Interrupted) and stream and exc.code() == grpc.StatusCode.INTERNAL:
                    error = Unavailable(f"state stream cut: {exc.details()}")
                if error is None:
                    raise
                if not isinstance(error, Unavailable) or attempt == policy.attempts - 1:
                    raise error from exc
            await asyncio.sleep(policy.backoff(attempt))
        raise AssertionError("unreachable")

    async def _unary(self, method: str, request) -> Any:
        rpc = getattr(self._stub, method)
        return await self._retrying(lambda: rpc(request, timeout=self.config.timeout_s,
                                                metadata=self._metadata))

    # -- lease proofs -----------------------------------------------------------------

    def _remember(self, conv: ConversationRef, lease: pb.Lease) -> None:
        # Kept after release too (bounded, least recent out): a late call with the bare
        # token must still present its proof to learn it is stale, not merely invalid.
        self._proofs[(conv, lease.token)] = lease.proof
        self._proofs.move_to_end((conv, lease.token))
        while len(self._proofs) > self.config.max_remembered_leases:
            self._proofs.popitem(last=False)

    def _fence(self, conv: ConversationRef, lease: LeaseArg, proof: bytes | None) -> tuple[int, bytes]:
        """(token, proof) for a fenced call; an unknown bare token goes without a proof
        (the service then answers LeaseLost)."""
        if isinstance(lease, pb.Lease):
            return lease.token, proof or lease.proof
        return lease, proof or self._proofs.get((conv, lease), b"")

    # -- leases -----------------------------------------------------------------------

    async def acquire_lease(self, conv: ConversationRef, ttl_ms: int, *, holder: str | None = None,
                            wait_s: float = 0.0) -> pb.Lease:
        """Take the conversation's lease; LeaseHeld if busy for longer than wait_s.

        The Lease carries `token`, `proof` (pass the Lease itself to fenced calls) and
        `head`, the conversation's current head (version 0 if it has none yet), so no
        separate get_head is needed before a turn."""
        request = pb.AcquireLeaseRequest(
            key=key_message(conv), ttl_ms=ttl_ms,
            holder=holder or f"{self.config.holder_prefix}:{uuid.uuid4().hex}",
            attempt_key=secrets.token_bytes(16))  # one per call: its retries get the same lease
        give_up = time.monotonic() + wait_s
        attempt = 0
        while True:
            try:
                lease = await self._unary("AcquireLease", request)
                self._remember(conv, lease)
                return lease
            except LeaseHeld:
                if time.monotonic() >= give_up:
                    raise
            await asyncio.sleep(min(self.config.retry.backoff(attempt), max(give_up - time.monotonic(), 0)))
            attempt += 1

    async def renew_lease(self, conv: ConversationRef, token: LeaseArg, ttl_ms: int, *,
                          lease_proof: bytes | None = None, timeout_s: float | None = None) -> pb.Lease:
        """With `timeout_s` one attempt within that deadline (a keeper retries at its next tick)."""
        token, proof = self._fence(conv, token, lease_proof)
        request = pb.RenewLeaseRequest(key=key_message(conv), token=token, ttl_ms=ttl_ms, lease_proof=proof)
        if timeout_s is None:
            return await self._unary("RenewLease", request)
        return await self._once("RenewLease", request, timeout_s)

    async def release_lease(self, conv: ConversationRef, token: LeaseArg, *,
                            lease_proof: bytes | None = None) -> None:
        token, proof = self._fence(conv, token, lease_proof)
        await self._unary("ReleaseLease", pb.ReleaseLeaseRequest(key=key_message(conv), token=token, lease_proof=proof))

    # -- heads and ledger -------------------------------------------------------------

    async def get_head(self, conv: ConversationRef) -> pb.Head:
        """NotFound when the conversation has no head (or the salt is wrong)."""
        return await self._unary("GetHead", pb.GetHeadRequest(key=key_message(conv)))

    async def get_head_or_none(self, conv: ConversationRef) -> pb.Head | None:
        try:
            return await self.get_head(conv)
        except NotFound:
            return None

    async def publish_turn(self, conv: ConversationRef, *, lease_token: LeaseArg, expected_version: int,
                           messages: Sequence[pb.Message | Mapping[str, Any]],
                           token_ids: Sequence[int], committed_tokens: int, tokens_sha256: str,
                           owner_replica: str = "", release_lease: bool = True,
                           publish_id: str | None = None, lease_proof: bytes | None = None,
                           result: pb.TurnResult | None = None) -> pb.Head:
        """Commit a turn: CAS on expected_version, fenced by the lease.

        token_ids are this turn's new tokens (suffix prompt + generated); the server
        checks committed_tokens == previous committed_tokens + len(token_ids).
        """
        token, proof = self._fence(conv, lease_token, lease_proof)
        request = pb.PublishTurnRequest(
            key=key_message(conv), lease_token=token, lease_proof=proof, expected_version=expected_version,
            turn=pb.LedgerTurn(messages=_messages(messages), token_ids=token_ids, result=result),
            committed_tokens=committed_tokens, tokens_sha256=tokens_sha256,
            owner_replica=owner_replica, release_lease=release_lease,
            publish_id=publish_id or uuid.uuid4().hex)
        return await self._unary("PublishTurn", request)

    async def discard(self, conv: ConversationRef, lease_token: LeaseArg, *,
                      lease_proof: bytes | None = None) -> pb.Head:
        """Give up a turn: release the lease, keep the head. A lease already lost is
        not an error here (the head is unchanged either way); returns the head
        (version 0 if the conversation has none)."""
        token, proof = self._fence(conv, lease_token, lease_proof)
        try:
            head = await self._unary("Discard", pb.DiscardRequest(key=key_message(conv), lease_token=token,
                                                                   lease_proof=proof))
        except LeaseLost:
            head = await self.get_head_or_none(conv) or pb.Head()
        return head

    async def rewind_conversation(self, conv: ConversationRef, *, lease_token: LeaseArg,
                                  expected_version: int, turn: int, owner_replica: str = "",
                                  lease_proof: bytes | None = None) -> pb.Head:
        """Keep turns 1..turn as a new head version (turn 0: an empty history); the lease
        stays held. Regenerating the last turn = rewind to turn - 1, then publish."""
        token, proof = self._fence(conv, lease_token, lease_proof)
        return await self._unary("RewindConversation", pb.RewindConversationRequest(
            key=key_message(conv), lease_token=token, lease_proof=proof, expected_version=expected_version,
            turn=turn, owner_replica=owner_replica))

    async def fork_conversation(self, conv: ConversationRef, new_conversation_id: str, *, turn: int,
                                expected_version: int = 0) -> pb.Head:
        """Copy turns 1..turn into conv.fork(new_conversation_id) (same salt) and
        return its head (version 1); AlreadyExists if it has one."""
        return await self._unary("ForkConversation", pb.ForkConversationRequest(
            key=key_message(conv), new_conversation_id=new_conversation_id, turn=turn,
            expected_version=expected_version))

    async def ledger_pages(self, conv: ConversationRef, *, from_turn: int = 1
                           ) -> AsyncIterator[pb.ReadLedgerResponse]:
        """The ledger page by page, as the service cuts it (by turns and by bytes)."""
        nxt = max(from_turn, 1)
        while nxt:
            page = await self._unary("ReadLedger", pb.ReadLedgerRequest(key=key_message(conv), from_turn=nxt))
            yield page
            nxt = page.next_turn

    async def read_ledger(self, conv: ConversationRef, *, from_turn: int = 1,
                          max_turns: int = 0) -> pb.ReadLedgerResponse:
        """Turns from `from_turn` on (all of them, or at most max_turns), gathered over
        as many pages as needed, all from one head version: if the head moves between
        pages (a publish, a rewind), the read starts over. `next_turn` is where a
        max_turns-limited read stopped (0 = the end)."""
        for _ in range(self.config.max_ledger_page_restarts):
            out = pb.ReadLedgerResponse(next_turn=max(from_turn, 1))
            while out.next_turn and not (max_turns and len(out.turns) >= max_turns):
                page = await self._unary("ReadLedger", pb.ReadLedgerRequest(
                    key=key_message(conv), from_turn=out.next_turn,
                    max_turns=max_turns - len(out.turns) if max_turns else 0))
                if out.HasField("head") and page.head.version != out.head.version:
                    break  # the head moved between pages: start over
                out.head.CopyFrom(page.head)
                out.turns.extend(page.turns)
                out.next_turn = page.next_turn
            else:
                return out
        raise VersionConflict("the ledger kept changing while it was read", current_version=out.head.version)

    async def delete_conversation(self, conv: ConversationRef) -> bool:
        reply = await self._unary("DeleteConversation", pb.DeleteConversationRequest(key=key_message(conv)))
        return reply.existed

    async def transfer_ownership(self, conv: ConversationRef, *, lease_token: LeaseArg,
                                 expected_version: int, new_owner: str,
                                 lease_proof: bytes | None = None) -> pb.Head:
        token, proof = self._fence(conv, lease_token, lease_proof)
        return await self._unary("TransferOwnership", pb.TransferOwnershipRequest(
            key=key_message(conv), lease_token=token, lease_proof=proof, expected_version=expected_version,
            new_owner=new_owner))

    # -- the prefix index -------------------------------------------------------------

    async def announce_prefixes(self, replica: str, entries: Sequence[tuple[str, int]]) -> None:
        """Record that `replica` holds the state of each (prefix name, tokens); more than one
        request's worth (SERVICE_LIMITS.max_prefix_entries) is sent in several."""
        step = SERVICE_LIMITS.max_prefix_entries
        for start in range(0, len(entries), step):
            await self._unary("AnnouncePrefixes", pb.AnnouncePrefixesRequest(replica=replica, entries=[
                pb.PrefixEntry(name=name, tokens=tokens) for name, tokens in entries[start:start + step]]))

    async def forget_prefixes(self, replica: str, names: Sequence[str]) -> None:
        """`replica` no longer holds these prefixes (names it never announced are fine)."""
        step = SERVICE_LIMITS.max_prefix_entries
        for start in range(0, len(names), step):
            await self._unary("ForgetPrefixes", pb.ForgetPrefixesRequest(
                replica=replica, names=list(names[start:start + step])))

    async def find_prefix(self, names: Sequence[str], *, timeout_s: float | None = None) -> PrefixMatch | None:
        """The longest prefix among `names` (a chat's message_prefix_digests) that a replica
        holds, None if none does. With `timeout_s` the call is one attempt within that deadline
        (a routing hint must not wait for retries); without, as every call."""
        if not names:
            return None
        request = pb.FindPrefixRequest(names=list(names))
        if timeout_s is None:
            reply = await self._unary("FindPrefix", request)
        else:
            reply = await self._once("FindPrefix", request, timeout_s)
        if reply.index < 0:
            return None
        return PrefixMatch(reply.index, tuple((h.replica, h.tokens) for h in reply.holders))

    async def _once(self, method: str, request, timeout_s: float) -> Any:
        """One attempt, no retries; errors typed as by the retry loop."""
        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            error = from_status(exc.code(), exc.details() or "", exc.trailing_metadata())
            if error is None:
                raise
            raise error from exc

    async def stats(self) -> pb.Stats:
        return await self._unary("GetStats", pb.GetStatsRequest())

    # -- state tier (chunks and manifests: state_chunks.py) -----------------------------
    async def put_state(self, conv: ConversationRef, version: int | pb.Head,
                        data: bytes | Sequence[bytes], *, incarnation: str | None = None,
                        lease: pb.Lease | None = None) -> pb.PutStateResponse:
        """Export the state of a head. Only chunks the tier lacks travel.

        Pass the exported Head as `version` (or its version and `incarnation=`): the
        put is then refused if the conversation was deleted and re-created meanwhile.
        With a bare version number the client looks the incarnation up first, which
        cannot tell a re-created conversation at the same version from the old one.
        With `lease`, the put is also fenced: refused unless that lease is still live.

        Pass a sequence of chunks to choose the boundaries (e.g. one per KV block
        group, so unchanged blocks hash the same from one export to the next); a
        single bytes object is cut into config.chunk_bytes pieces.
        """
        if isinstance(version, pb.Head):
            version, incarnation = version.version, version.incarnation
        if incarnation is None:
            head = await self.get_head(conv)
            if head.version != version:
                raise VersionConflict(f"put_state: head version is {head.version}",
                                      current_version=head.version)
            incarnation = head.incarnation
        chunks = state_chunks.cut(data, self.config.chunk_bytes)
        digests = await asyncio.to_thread(lambda: [hashing.sha256(c) for c in chunks])
        manifest = state_chunks.manifest(key_message(conv), version, incarnation, chunks, digests, lease)
        missing = await self._unary("MissingChunks", pb.MissingChunksRequest(
            key=key_message(conv), digests=list(dict.fromkeys(digests))))
        try:
            return await self._put_stream(manifest, chunks, digests, set(missing.digests))
        except MissingChunks:
            # Chunks the tier held a moment ago were superseded meanwhile: send all.
            return await self._put_stream(manifest, chunks, digests, set(digests))

    async def _put_stream(self, manifest: pb.StateManifest, chunks: Sequence[bytes],
                          digests: Sequence[bytes], send: set[bytes]) -> pb.PutStateResponse:
        return await self._retrying(
            lambda: self._stub.PutState(state_chunks.put_requests(manifest, chunks, digests, send),
                                        timeout=self.config.stream_timeout_s,
                                        metadata=self._metadata), stream=True)

    async def get_state(self, conv: ConversationRef, version: int = 0) -> tuple[int, bytes]:
        """Import a head's state: (version, bytes), every chunk verified end to end."""
        async def attempt() -> tuple[int, bytes]:
            call = self._stub.GetState(pb.GetStateRequest(key=key_message(conv), version=version),
                                       timeout=self.config.stream_timeout_s, metadata=self._metadata)
            return await state_chunks.read_verified(call)

        return await self._retrying(attempt, stream=True)
