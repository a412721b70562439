"""The CacheService handlers: validate, call the store or the tier, reply.

Head replies always report the tier version the tier actually holds, which is the
only truth after a service restart (the tier's index lives in this process).
"""

from __future__ import annotations

import asyncio
import weakref

from cache_service import errors, validation
from cache_service.config import Limits
from cache_service.hashing import sha256
from cache_service.keys import ConversationKeys
from cache_service.rpc import RpcCounters, rpc
from cache_service.store import MetadataStore
from cache_service.tier import ChunkRef, StateTier
from proto import cache_pb2 as pb
from proto import cache_pb2_grpc


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, store: MetadataStore, tier: StateTier, limits: Limits):
        self.store = store
        self.tier = tier
        self.limits = limits
        self.counters = RpcCounters()
        # Serializes tier commits against deletes of the same conversation, so a put
        # racing a delete cannot resurrect the deleted state.
        self._conv_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def _lock(self, keys: ConversationKeys) -> asyncio.Lock:
        lock = self._conv_locks.get(keys.conv_hash)
        if lock is None:
            lock = self._conv_locks[keys.conv_hash] = asyncio.Lock()
        return lock

    def _with_tier(self, keys: ConversationKeys, head: pb.Head) -> pb.Head:
        head.tier_version = self.tier.version_of(keys.conv_hash)
        return head

    def _key(self, key: pb.ConversationKey) -> ConversationKeys:
        return validation.conversation(key, self.limits)

    # -- replicas -----------------------------------------------------------------

    @rpc
    async def RegisterReplica(self, request, context):
        validation.identifier(request.replica_id, "replica_id", self.limits)
        validation.identifier(request.address, "address", self.limits)
        validation.ttl(request.ttl_ms, self.limits)
        replica = await self.store.register_replica(request.replica_id, request.address, request.ttl_ms)
        return pb.RegisterReplicaResponse(replica=replica)

    @rpc
    async def Heartbeat(self, request, context):
        validation.identifier(request.replica_id, "replica_id", self.limits)
        validation.ttl(request.ttl_ms, self.limits)
        return pb.HeartbeatResponse(replica=await self.store.heartbeat(request))

    @rpc
    async def ListReplicas(self, request, context):
        return pb.ListReplicasResponse(replicas=await self.store.list_replicas())

    # -- leases -------------------------------------------------------------------

    @rpc
    async def AcquireLease(self, request, context):
        keys = self._key(request.key)
        validation.identifier(request.holder, "holder", self.limits)
        validation.ttl(request.ttl_ms, self.limits)
        return await self.store.acquire(keys, request.holder, request.ttl_ms)

    @rpc
    async def RenewLease(self, request, context):
        keys = self._key(request.key)
        validation.ttl(request.ttl_ms, self.limits)
        return await self.store.renew(keys, validation.token(request.token, "token"), request.ttl_ms)

    @rpc
    async def ReleaseLease(self, request, context):
        keys = self._key(request.key)
        await self.store.release(keys, validation.token(request.token, "token"))
        return pb.ReleaseLeaseResponse()

    # -- heads and ledger ---------------------------------------------------------

    @rpc
    async def GetHead(self, request, context):
        keys = self._key(request.key)
        return self._with_tier(keys, await self.store.get_head(keys))

    @rpc
    async def PublishTurn(self, request, context):
        keys = validation.publish(request, self.limits)
        return self._with_tier(keys, await self.store.publish(keys, request))

    @rpc
    async def Discard(self, request, context):
        keys = self._key(request.key)
        head = await self.store.discard(keys, validation.token(request.lease_token))
        return self._with_tier(keys, head) if head is not None else pb.Head()

    @rpc
    async def ReadLedger(self, request, context):
        keys = self._key(request.key)
        cap = self.limits.max_ledger_turns_per_read
        if request.max_turns > cap:
            raise errors.InvalidArgument(f"max_turns must be <= {cap}")
        head, turns = await self.store.read_ledger(keys, request.from_turn, request.max_turns or cap)
        return pb.ReadLedgerResponse(head=self._with_tier(keys, head), turns=turns)

    @rpc
    async def DeleteConversation(self, request, context):
        keys = self._key(request.key)
        async with self._lock(keys):
            existed = await self.store.delete(keys)
            dropped = self.tier.drop(keys.conv_hash)
        return pb.DeleteConversationResponse(existed=existed or dropped)

    @rpc
    async def TransferOwnership(self, request, context):
        keys = self._key(request.key)
        validation.identifier(request.new_owner, "new_owner", self.limits)
        head = await self.store.transfer(keys, validation.token(request.lease_token),
                                         request.expected_version, request.new_owner)
        return self._with_tier(keys, head)

    # -- state tier ---------------------------------------------------------------

    @rpc
    async def MissingChunks(self, request, context):
        keys = self._key(request.key)
        digests = validation.digests(request.digests, "digests", self.limits)
        return pb.MissingChunksResponse(digests=self.tier.missing(keys.conv_hash, digests))

    @rpc
    async def PutState(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("manifest"):
            raise errors.InvalidArgument("a PutState stream must start with the manifest")
        manifest = first.manifest
        keys = validation.manifest(manifest, self.limits)
        refs = [ChunkRef(c.digest, c.size) for c in manifest.chunks]
        sizes = {r.digest: r.size for r in refs}
        staged: dict[bytes, bytes] = {}
        async for message in request_iterator:
            staged_chunk = await self._verified_chunk(message, sizes, len(staged))
            staged[staged_chunk.digest] = staged_chunk.data
        conv = keys.conv_hash
        async with self._lock(keys):
            # Refuse before marking Redis if something is missing (cheap, common case).
            unsent = [d for d in sizes if d not in staged]
            if self.tier.missing(conv, unsent):
                raise errors.MissingChunks("the stream lacks chunks the tier does not hold; resend them")
            head = await self.store.mark_tier(keys, manifest.version)
            reused = await asyncio.to_thread(self.tier.commit, conv, manifest.version, refs, staged)
        return pb.PutStateResponse(total_bytes=sum(r.size for r in refs), chunks_sent=len(staged),
                                   chunks_reused=reused, head=self._with_tier(keys, head))

    async def _verified_chunk(self, message: pb.PutStateRequest, sizes: dict[bytes, int],
                              index: int) -> pb.Chunk:
        if not message.HasField("chunk"):
            raise errors.InvalidArgument("only chunks may follow the manifest")
        chunk = message.chunk
        if chunk.digest not in sizes:
            raise errors.InvalidArgument(f"chunk #{index} has a digest that is not in the manifest")
        if len(chunk.data) != sizes[chunk.digest]:
            raise errors.InvalidArgument(f"chunk #{index} is {len(chunk.data)} bytes, the manifest "
                                         f"says {sizes[chunk.digest]}")
        if await asyncio.to_thread(sha256, chunk.data) != chunk.digest:
            raise errors.InvalidArgument(f"chunk #{index} does not match its sha256 digest "
                                         "(corrupted in transit); nothing stored")
        return chunk

    @rpc
    async def GetState(self, request, context):
        keys = self._key(request.key)
        conv = keys.conv_hash
        entry = self.tier.entry(conv, request.version)
        yield pb.GetStateResponse(manifest=pb.StateManifest(
            key=request.key, version=entry.version,
            chunks=[pb.ChunkRef(digest=r.digest, size=r.size) for r in entry.chunks]))
        for ref in entry.chunks:
            data = await asyncio.to_thread(self.tier.read_chunk, conv, entry, ref)
            yield pb.GetStateResponse(chunk=pb.Chunk(digest=ref.digest, data=data))

    @rpc
    async def GetStats(self, request, context):
        t = self.tier.stats()
        replicas = await self.store.list_replicas()
        return pb.Stats(
            tier_memory_bytes=t.memory_bytes, tier_disk_bytes=t.disk_bytes,
            tier_budget_bytes=self.tier.budget_bytes, tier_entries=t.entries,
            tier_chunks=t.chunks, tier_spills=t.spills, tier_disk_reads=t.disk_reads,
            tier_checksum_failures=t.checksum_failures, live_replicas=len(replicas),
            rpc_counts=dict(self.counters.calls), rpc_errors=dict(self.counters.errors))
