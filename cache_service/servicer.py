"""The CacheService handlers: validate, call the store or the tier, reply.

The event loop never waits on the tier's lock (held during disk I/O): tier calls other than
its lock-free reads go through `asyncio.to_thread`, so a spill stalls no other RPC.

Head replies of a single instance report the tier version its tier actually holds, which is
the only truth after a service restart (the tier's index lives in this process). Instances that
share the tier (TierPlacement.RENDEZVOUS) report what Redis recorded at the last accepted put:
the entry lives on other instances, and one lost with its instance is found missing at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import weakref
from collections.abc import AsyncIterator, Callable

from cache_service import errors, validation
from cache_service.config import Limits, PutLimits, TierPlacement
from cache_service.hashing import sha256
from cache_service.keys import ConversationKeys, PrefixKeys
from cache_service.leases import Fence, LeaseSigner
from cache_service.prefix_tier import PrefixEntry, namespace
from cache_service.rpc import RpcCounters, rpc
from cache_service.store import MetadataStore
from cache_service.tier import ChunkRef, StateTier
from cache_service.tier_hints import TierHints
from proto import cache_pb2 as pb
from proto import cache_pb2_grpc


class StagingBudget:
    """Bytes held by PutState streams before their commit, across all streams.

    Used from the event loop only (reserve/release never await), so no lock."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def reserve(self, size: int) -> None:
        if self.used + size > self.limit:
            raise errors.ResourceExhausted(
                f"state puts in flight already hold {self.used} of {self.limit} staging bytes; "
                "retry later")
        self.used += size

    def release(self, size: int) -> None:
        self.used -= size
        assert self.used >= 0, "staging accounting went negative"


def publish_digest(request: pb.PublishTurnRequest) -> str:
    """What a retried publish must repeat exactly: everything but the lease proof."""
    clone = pb.PublishTurnRequest()
    clone.CopyFrom(request)
    clone.lease_token, clone.lease_proof = 0, b""
    return hashlib.sha256(clone.SerializeToString(deterministic=True)).hexdigest()


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, store: MetadataStore, tier: StateTier, signer: LeaseSigner, *,
                 limits: Limits, puts: PutLimits, fence_ttl_ms: Callable[[int], int], prefix_ttl_ms: int,
                 placement: TierPlacement = TierPlacement.SINGLE):
        self.store = store
        self.placement = placement
        self.tier = tier
        self.signer = signer
        self.limits = limits
        self.puts = puts
        self.staging = StagingBudget(puts.max_staged_bytes)
        self._fence_ttl_ms = fence_ttl_ms  # of the lease's TTL (ServerConfig.fence_ttl_ms)
        self._prefix_ttl_ms = prefix_ttl_ms
        self.counters = RpcCounters()
        self.hints = TierHints(store.prefixes, tier, prefix_ttl_ms, limits.max_prefix_entries)
        # Serializes tier commits against deletes and rewinds of the same conversation,
        # so a put racing them cannot resurrect state they dropped.
        self._conv_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def _lock(self, keys: ConversationKeys) -> asyncio.Lock:
        lock = self._conv_locks.get(keys.conv_hash)
        if lock is None:
            lock = self._conv_locks[keys.conv_hash] = asyncio.Lock()
        return lock

    def _with_tier(self, keys: ConversationKeys, head: pb.Head) -> pb.Head:
        if self.placement is TierPlacement.SINGLE:
            head.tier_version = self.tier.version_of(keys.conv_hash)
        return head

    def _key(self, key: pb.ConversationKey) -> ConversationKeys:
        return validation.conversation(key, self.limits)

    def _fence(self, keys: ConversationKeys, token: int, proof: bytes, field: str = "lease_token") -> Fence:
        return self.signer.verify(keys.conv_hash, validation.token(token, field), proof)

    # -- leases -------------------------------------------------------------------

    @rpc
    async def AcquireLease(self, request, context):
        keys = self._key(request.key)
        validation.identifier(request.holder, "holder", self.limits)
        validation.lease_ttl(request.ttl_ms, self.limits)
        attempt = validation.attempt_key(request.attempt_key)
        token, incarnation, expires_at_ms, head = await self.store.acquire(
            keys, request.holder, request.ttl_ms, hashlib.sha256(attempt).hexdigest() if attempt else "",
            self._fence_ttl_ms(request.ttl_ms))
        return pb.Lease(holder=request.holder, token=token, expires_at_ms=expires_at_ms,
                        proof=self.signer.proof(keys.conv_hash, incarnation, token),
                        head=self._with_tier(keys, head) if head is not None else pb.Head())

    @rpc
    async def RenewLease(self, request, context):
        keys = self._key(request.key)
        validation.lease_ttl(request.ttl_ms, self.limits)
        fence = self._fence(keys, request.token, request.lease_proof, "token")
        lease = await self.store.renew(keys, fence, request.ttl_ms, self._fence_ttl_ms(request.ttl_ms))
        lease.proof = request.lease_proof
        return lease

    @rpc
    async def ReleaseLease(self, request, context):
        keys = self._key(request.key)
        await self.store.release(keys, self._fence(keys, request.token, request.lease_proof, "token"))
        return pb.ReleaseLeaseResponse()

    # -- heads and ledger ---------------------------------------------------------

    @rpc
    async def GetHead(self, request, context):
        keys = self._key(request.key)
        return self._with_tier(keys, await self.store.get_head(keys))

    @rpc
    async def PublishTurn(self, request, context):
        keys = validation.publish(request, self.limits)
        fence = self._fence(keys, request.lease_token, request.lease_proof)
        head = await self.store.publish(keys, request, fence, publish_digest(request))
        return self._with_tier(keys, head)

    @rpc
    async def Discard(self, request, context):
        keys = self._key(request.key)
        head = await self.store.discard(keys, self._fence(keys, request.lease_token, request.lease_proof))
        return self._with_tier(keys, head) if head is not None else pb.Head()

    @rpc
    async def ReadLedger(self, request, context):
        keys = self._key(request.key)
        cap = self.limits.max_ledger_turns_per_read
        if request.max_turns > cap:
            raise errors.InvalidArgument(f"max_turns must be <= {cap}")
        head, turns, next_turn = await self.store.read_ledger(
            keys, request.from_turn, request.max_turns or cap, self.limits.ledger_page_bytes)
        return pb.ReadLedgerResponse(head=self._with_tier(keys, head), turns=turns, next_turn=next_turn)

    @rpc
    async def DeleteConversation(self, request, context):
        keys = self._key(request.key)
        async with self._lock(keys):
            existed = await self.store.delete(keys)
            dropped = await asyncio.to_thread(self.tier.drop, keys.conv_hash)
        return pb.DeleteConversationResponse(existed=existed or dropped)

    async def sweep_tier(self) -> int:
        """Drop the tier entries of conversations that no longer have a head (they expired, or a
        delete's tier drop was lost with a crash); returns how many. Each is re-checked under the
        conversation's lock, so a put for a conversation created meanwhile is never dropped."""
        convs = self.tier.conversations()
        if not convs:
            return 0
        dropped = 0
        for conv, exists in zip(convs, await self.store.heads_exist(convs)):
            if exists:
                continue
            keys = ConversationKeys(conv)
            async with self._lock(keys):
                if not (await self.store.heads_exist([conv]))[0]:
                    dropped += self.tier.drop(conv)
        return dropped

    @rpc
    async def TransferOwnership(self, request, context):
        keys = self._key(request.key)
        validation.identifier(request.new_owner, "new_owner", self.limits)
        fence = self._fence(keys, request.lease_token, request.lease_proof)
        head = await self.store.transfer(keys, fence, request.expected_version, request.new_owner)
        return self._with_tier(keys, head)

    @rpc
    async def RewindConversation(self, request, context):
        keys = self._key(request.key)
        validation.identifier(request.owner_replica, "owner_replica", self.limits, required=False)
        fence = self._fence(keys, request.lease_token, request.lease_proof)
        async with self._lock(keys):
            head = await self.store.rewind(keys, fence, request.expected_version, request.turn,
                                           request.owner_replica)
            # The tier's entry is the state of a later turn: unreachable from now on.
            await asyncio.to_thread(self.tier.drop, keys.conv_hash)
        return self._with_tier(keys, head)

    @rpc
    async def ForkConversation(self, request, context):
        source = self._key(request.key)
        target = self._key(pb.ConversationKey(conversation_id=request.new_conversation_id,
                                              cache_salt=request.key.cache_salt))
        if target == source:
            raise errors.InvalidArgument("new_conversation_id must differ from the source's")
        head = await self.store.fork(source, target, request.turn, request.expected_version)
        return self._with_tier(target, head)

    # -- state tier ---------------------------------------------------------------

    @rpc
    async def MissingChunks(self, request, context):
        if request.HasField("prefix"):
            ns = namespace(validation.prefix_request(request).scope)
        else:
            ns = self._key(request.key).conv_hash
        digests = validation.digests(request.digests, "digests", self.limits)
        return pb.MissingChunksResponse(digests=await asyncio.to_thread(self.tier.missing, ns, digests))

    async def _next(self, requests) -> pb.PutStateRequest | None:
        """The stream's next message, or None at its end; an idle stream is cut."""
        try:
            return await asyncio.wait_for(anext(requests, None), self.puts.idle_timeout_s)
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"PutState stream sent nothing for {self.puts.idle_timeout_s} s; cut") from None

    @rpc
    async def PutState(self, request_iterator, context):
        requests = aiter(request_iterator)
        first = await self._next(requests)
        if first is None or not first.HasField("manifest"):
            raise errors.InvalidArgument("a PutState stream must start with the manifest")
        manifest = first.manifest
        refs = [ChunkRef(c.digest, c.size) for c in manifest.chunks]
        if manifest.HasField("prefix"):
            return await self._put_prefix(manifest, refs, requests)
        keys = validation.manifest(manifest, self.limits)
        fence = self._fence(keys, manifest.lease_token, manifest.lease_proof) if manifest.lease_token else None
        conv = keys.conv_hash
        async with self._staged(requests, conv, refs) as staged:
            async with self._lock(keys):
                # Refuse before marking Redis if something is missing (cheap, common case).
                unsent = [r.digest for r in refs if r.digest not in staged]
                if await asyncio.to_thread(self.tier.missing, conv, unsent):
                    raise errors.MissingChunks("the stream lacks chunks the tier does not hold; resend them")
                head = await self.store.mark_tier(keys, manifest.version, manifest.incarnation, fence)
                reused = await asyncio.to_thread(self.tier.commit, conv, manifest.incarnation,
                                                 manifest.version, refs, staged)
        return pb.PutStateResponse(total_bytes=sum(r.size for r in refs), chunks_sent=len(staged),
                                   chunks_reused=reused, head=self._with_tier(keys, head))

    async def _put_prefix(self, manifest: pb.StateManifest, refs: list[ChunkRef], requests) -> pb.PutStateResponse:
        """A prefix checkpoint: no head to mark, no lease; once committed, the tier is announced
        as a holder of its name (refreshed by every put and read, so it lives as long as the entry)."""
        key = validation.prefix_manifest(manifest, self.limits)
        entry = PrefixEntry((key.scope, key.name), key.tokens, tuple(refs))
        self.tier.check_prefix_fits(entry.chunks)  # before its bytes travel
        async with self._staged(requests, entry.namespace, refs) as staged:
            reused = await asyncio.to_thread(self.tier.commit_prefix, entry, staged)
        await self.hints.announce(entry)
        return pb.PutStateResponse(total_bytes=entry.total_bytes, chunks_sent=len(staged), chunks_reused=reused)

    @contextlib.asynccontextmanager
    async def _staged(self, requests, ns: str, refs: list[ChunkRef]) -> AsyncIterator[dict[bytes, bytes]]:
        """The stream's chunks, each verified, held against the staging budget until the
        caller's commit is done."""
        await asyncio.to_thread(self.tier.check_sizes, ns, refs)
        sizes = {r.digest: r.size for r in refs}
        to_send = sum(sizes[d] for d in await asyncio.to_thread(self.tier.missing, ns, list(sizes)))
        if to_send > self.staging.limit:
            raise errors.InvalidArgument(f"this put would send {to_send} bytes, over the service's "
                                         f"staging limit of {self.staging.limit}")
        staged: dict[bytes, bytes] = {}
        reserved = 0
        try:
            while (message := await self._next(requests)) is not None:
                size = len(message.chunk.data)
                # Counted before hashing: the bytes are held from now on.
                self.staging.reserve(size)
                reserved += size
                chunk = await self._verified_chunk(message, sizes, staged)
                staged[chunk.digest] = chunk.data
            yield staged
        finally:
            self.staging.release(reserved)

    async def _verified_chunk(self, message: pb.PutStateRequest, sizes: dict[bytes, int],
                              staged: dict[bytes, bytes]) -> pb.Chunk:
        index = len(staged)
        if not message.HasField("chunk"):
            raise errors.InvalidArgument("only chunks may follow the manifest")
        chunk = message.chunk
        if chunk.digest not in sizes:
            raise errors.InvalidArgument(f"chunk #{index} has a digest that is not in the manifest")
        if chunk.digest in staged:
            raise errors.InvalidArgument(f"chunk #{index} was already sent in this stream")
        if len(chunk.data) != sizes[chunk.digest]:
            raise errors.InvalidArgument(f"chunk #{index} is {len(chunk.data)} bytes, the manifest "
                                         f"says {sizes[chunk.digest]}")
        if await asyncio.to_thread(sha256, chunk.data) != chunk.digest:
            raise errors.InvalidArgument(f"chunk #{index} does not match its sha256 digest "
                                         "(corrupted in transit); nothing stored")
        return chunk

    @rpc
    async def GetState(self, request, context):
        if request.HasField("prefix"):
            key = validation.prefix_request(request)
            entry = await asyncio.to_thread(self.tier.prefix_entry, key.scope, key.name)
            ns = entry.namespace
            manifest = pb.StateManifest(prefix=pb.PrefixStateKey(scope=key.scope, name=key.name, tokens=entry.tokens))
        else:
            ns = self._key(request.key).conv_hash
            entry = self.tier.entry(ns, request.version)
            manifest = pb.StateManifest(key=request.key, version=entry.version, incarnation=entry.incarnation)
        manifest.chunks.extend(pb.ChunkRef(digest=r.digest, size=r.size) for r in entry.chunks)
        yield pb.GetStateResponse(manifest=manifest)
        for ref in entry.chunks:
            data = await asyncio.to_thread(self.tier.read_chunk, ns, entry, ref)
            yield pb.GetStateResponse(chunk=pb.Chunk(digest=ref.digest, data=data))
        if isinstance(entry, PrefixEntry):
            await self.hints.refresh(entry)

    # -- prefix index -------------------------------------------------------------------

    @rpc
    async def AnnouncePrefixes(self, request, context):
        entries = validation.announce_prefixes(request, self.limits)
        keys = PrefixKeys(validation.prefix_scope(request.scope))
        if entries:
            await self.store.prefixes.announce(keys, request.replica, entries, self._prefix_ttl_ms)
        return pb.AnnouncePrefixesResponse()

    @rpc
    async def ForgetPrefixes(self, request, context):
        validation.replica(request.replica, self.limits)
        names = validation.prefix_names(request.names, "names", self.limits.max_prefix_entries)
        keys = PrefixKeys(validation.prefix_scope(request.scope))
        if names:
            await self.store.prefixes.forget(keys, request.replica, names)
        return pb.ForgetPrefixesResponse()

    @rpc
    async def FindPrefix(self, request, context):
        names = validation.prefix_names(request.names, "names", self.limits.max_prefix_names)
        index, holders = await self.store.prefixes.find(PrefixKeys(validation.prefix_scope(request.scope)), names)
        return pb.FindPrefixResponse(index=index, holders=[
            pb.PrefixHolder(replica=replica, tokens=tokens, index=at) for replica, tokens, at in holders])

    @rpc
    async def GetStats(self, request, context):
        prefix_names = await self.store.prefixes.live_names()
        t = await asyncio.to_thread(self.tier.stats)
        return pb.Stats(
            tier_memory_bytes=t.memory_bytes, tier_disk_bytes=t.disk_bytes,
            tier_budget_bytes=self.tier.budget_bytes, tier_entries=t.entries,
            tier_chunks=t.chunks, tier_spills=t.spills, tier_disk_reads=t.disk_reads,
            tier_checksum_failures=t.checksum_failures,
            rpc_counts=dict(self.counters.calls), rpc_errors=dict(self.counters.errors),
            tier_staged_bytes=self.staging.used, prefix_index_names=prefix_names,
            tier_prefix_entries=t.prefix_entries, tier_prefix_bytes=t.prefix_bytes)
