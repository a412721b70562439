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

Several instances (`"a:50051,b:50051"`, or `"dns:///peers:50051"` for every address a name resolves
to): metadata calls go to any live instance and fail over to another on UNAVAILABLE (Redis holds
the metadata, so every instance answers the same); state-tier entries go to the instances that
rendezvous hashing ranks first for the conversation, or the prefix checkpoint (placement.py,
placed_tier.py). One plain address behaves as a single instance always did.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from cache_service import hashing, placed_tier, placement, state_chunks
from cache_service.errors import (  # noqa: F401 (the client's face: callers catch these from here)
    AlreadyExists, CacheError, DataLoss, DeadlineExceeded, Interrupted, InvalidArgument, LeaseHeld, LeaseLost,
    MissingChunks, NotFound, ResourceExhausted, StaleFence, StorageFull, Unauthenticated, Unavailable,
    VersionConflict,
)
from cache_service.client_config import SERVICE_LIMITS, ClientConfig, RetryPolicy  # noqa: F401 (the client's face)
from cache_service.client_prefixes import PrefixIndexCalls, PrefixMatch, scope_tag  # noqa: F401 (PrefixMatch: the client's face)
from cache_service.client_transport import Transport
from proto import cache_pb2 as pb
from proto import cache_pb2_grpc
from proto.contract import ConversationRef

TurnResult = pb.TurnResult  # what a committed turn answered (publish_turn(result=...))
SentReply, SentToolCall = pb.SentReply, pb.SentToolCall  # its reply as the client was sent it

def key_message(conv: ConversationRef) -> pb.ConversationKey:
    """The conversation as the wire names it: its id and salt, never its key (the service hashes)."""
    return pb.ConversationKey(conversation_id=conv.id, cache_salt=conv.salt)


LeaseArg = int | pb.Lease


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


class CacheClient(PrefixIndexCalls):
    def __init__(self, target: str, config: ClientConfig | None = None):
        """`target`: one address, or several and/or `dns:///name:port` entries, comma-separated."""
        self.config = config or ClientConfig()
        self.target = target
        self._calls = Transport(target, self.config)
        self._proofs: OrderedDict[tuple[ConversationRef, int], bytes] = OrderedDict()

    async def close(self) -> None:
        await self._calls.close()

    async def __aenter__(self) -> "CacheClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Until the service (one of its instances) accepts connections."""
        await self._calls.wait_ready(timeout_s)

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
                lease = await self._calls.unary("AcquireLease", request)
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
            return await self._calls.unary("RenewLease", request)
        return await self._calls.once("RenewLease", request, timeout_s)

    async def release_lease(self, conv: ConversationRef, token: LeaseArg, *,
                            lease_proof: bytes | None = None) -> None:
        token, proof = self._fence(conv, token, lease_proof)
        await self._calls.unary("ReleaseLease", pb.ReleaseLeaseRequest(key=key_message(conv), token=token, lease_proof=proof))

    # -- heads and ledger -------------------------------------------------------------

    async def get_head(self, conv: ConversationRef) -> pb.Head:
        """NotFound when the conversation has no head (or the salt is wrong)."""
        return await self._calls.unary("GetHead", pb.GetHeadRequest(key=key_message(conv)))

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
        return await self._calls.unary("PublishTurn", request)

    async def discard(self, conv: ConversationRef, lease_token: LeaseArg, *,
                      lease_proof: bytes | None = None) -> pb.Head:
        """Give up a turn: release the lease, keep the head. A lease already lost is
        not an error here (the head is unchanged either way); returns the head
        (version 0 if the conversation has none)."""
        token, proof = self._fence(conv, lease_token, lease_proof)
        try:
            head = await self._calls.unary("Discard", pb.DiscardRequest(key=key_message(conv), lease_token=token,
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
        return await self._calls.unary("RewindConversation", pb.RewindConversationRequest(
            key=key_message(conv), lease_token=token, lease_proof=proof, expected_version=expected_version,
            turn=turn, owner_replica=owner_replica))

    async def fork_conversation(self, conv: ConversationRef, new_conversation_id: str, *, turn: int,
                                expected_version: int = 0) -> pb.Head:
        """Copy turns 1..turn into conv.fork(new_conversation_id) (same salt) and
        return its head (version 1); AlreadyExists if it has one."""
        return await self._calls.unary("ForkConversation", pb.ForkConversationRequest(
            key=key_message(conv), new_conversation_id=new_conversation_id, turn=turn,
            expected_version=expected_version))

    async def ledger_pages(self, conv: ConversationRef, *, from_turn: int = 1
                           ) -> AsyncIterator[pb.ReadLedgerResponse]:
        """The ledger page by page, as the service cuts it (by turns and by bytes)."""
        nxt = max(from_turn, 1)
        while nxt:
            page = await self._calls.unary("ReadLedger", pb.ReadLedgerRequest(key=key_message(conv), from_turn=nxt))
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
                page = await self._calls.unary("ReadLedger", pb.ReadLedgerRequest(
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
        request = pb.DeleteConversationRequest(key=key_message(conv))
        if not self._calls.pool.single:
            # Sent to the instances holding the conversation's tier entry: each drops its copy (and
            # deletes in Redis, the later ones finding nothing). A holder that missed it drops its
            # copy at its next sweep; a re-created conversation never reads it (another incarnation).
            holders = (await self._calls.pool.ranked(conv.key))[:self.config.tier_copies]
            replies = await asyncio.gather(*(
                self._calls.once("DeleteConversation", request, self.config.timeout_s, address=a) for a in holders
            ), return_exceptions=True)
            answered = [r for r in replies if isinstance(r, pb.DeleteConversationResponse)]
            if answered:
                return any(r.existed for r in answered)
        reply = await self._calls.unary("DeleteConversation", request)
        return reply.existed

    async def transfer_ownership(self, conv: ConversationRef, *, lease_token: LeaseArg,
                                 expected_version: int, new_owner: str,
                                 lease_proof: bytes | None = None) -> pb.Head:
        token, proof = self._fence(conv, lease_token, lease_proof)
        return await self._calls.unary("TransferOwnership", pb.TransferOwnershipRequest(
            key=key_message(conv), lease_token=token, lease_proof=proof, expected_version=expected_version,
            new_owner=new_owner))

    async def stats(self) -> pb.Stats:
        return await self._calls.unary("GetStats", pb.GetStatsRequest())

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
        return await self._put(conv.key, manifest, chunks, digests)

    async def put_prefix_state(self, scope: str | None, name: str, tokens: int,
                               data: bytes | Sequence[bytes]) -> pb.PutStateResponse:
        """Export a prefix checkpoint: the state of the token prefix that `name` (a
        message_prefix_digests(scope, ...) entry) names, `tokens` long, owned by no conversation.
        The tier then holds it (replacing one of that name) and the prefix index names the tier,
        TIER_HOLDER, among its holders; chunks travel only if the scope's entries lack them."""
        prefix = pb.PrefixStateKey(scope=scope_tag(scope), name=name, tokens=tokens)
        chunks = state_chunks.cut(data, self.config.chunk_bytes)
        digests = await asyncio.to_thread(lambda: [hashing.sha256(c) for c in chunks])
        manifest = state_chunks.prefix_manifest(prefix, chunks, digests)
        return await self._put(placement.prefix_key(prefix.scope, name), manifest, chunks, digests)

    async def _put(self, placed_by: str, manifest: pb.StateManifest, chunks: Sequence[bytes],
                   digests: Sequence[bytes]) -> pb.PutStateResponse:
        if self._calls.pool.single:
            return await self._put_on(manifest, chunks, digests, self._calls.retrying)
        return await placed_tier.put(
            self._calls.pool, placed_by, self.config.tier_copies,
            lambda address: self._put_on(manifest, chunks, digests, self._calls.on(address)), self.config.retry)

    async def _put_on(self, manifest: pb.StateManifest, chunks: Sequence[bytes], digests: Sequence[bytes],
                      run: Callable[..., Any]) -> pb.PutStateResponse:
        """Ask which chunks the tier lacks, then stream the manifest and those; `run` makes each call
        (retrying on live instances, or once on one instance)."""
        missing = await run(lambda stub: stub.MissingChunks(
            state_chunks.missing_request(manifest, digests), timeout=self.config.timeout_s,
            metadata=self._calls.metadata))

        def stream(send: set[bytes]) -> Callable[[cache_pb2_grpc.CacheServiceStub], Any]:
            return lambda stub: stub.PutState(state_chunks.put_requests(manifest, chunks, digests, send),
                                              timeout=self.config.stream_timeout_s, metadata=self._calls.metadata)
        try:
            return await run(stream(set(missing.digests)), stream=True)
        except MissingChunks:
            # Chunks the tier held a moment ago were superseded meanwhile: send all.
            return await run(stream(set(digests)), stream=True)

    async def get_state(self, conv: ConversationRef, version: int = 0, *,
                        incarnation: str | None = None) -> tuple[int, bytes]:
        """Import a head's state: (version, bytes), every chunk verified end to end. With
        `incarnation` (the head's), state of another life of the conversation is NotFound."""
        return await self._get(conv.key, pb.GetStateRequest(key=key_message(conv), version=version), incarnation)

    async def get_prefix_state(self, scope: str | None, name: str) -> bytes:
        """Import a prefix checkpoint's bytes, every chunk verified end to end; NotFound if the
        tier does not hold it (never put, evicted, expired: the index's name is only a hint)."""
        tag = scope_tag(scope)
        request = pb.GetStateRequest(prefix=pb.PrefixStateKey(scope=tag, name=name))
        _, data = await self._get(placement.prefix_key(tag, name), request, None)
        return data

    async def _get(self, placed_by: str, request: pb.GetStateRequest, incarnation: str | None) -> tuple[int, bytes]:
        def attempt(stub: cache_pb2_grpc.CacheServiceStub) -> Any:
            return state_chunks.read_entry(stub.GetState(request, timeout=self.config.stream_timeout_s,
                                                         metadata=self._calls.metadata))
        if not self._calls.pool.single:
            return await placed_tier.get(self._calls.pool, placed_by, self.config.tier_copies,
                                         lambda address: self._calls.on(address)(attempt, stream=True),
                                         self.config.retry, incarnation=incarnation)
        manifest, data = await self._calls.retrying(attempt, stream=True)
        if incarnation is not None and manifest.incarnation != incarnation:
            raise NotFound("the state tier holds another incarnation of this conversation")
        return manifest.version, data
