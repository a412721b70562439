"""A head's state on the wire: cut into chunks, named by their digests in a manifest, sent as a
stream that carries only the chunks the tier lacks, and read back with every chunk verified."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Sequence

from cache_service import hashing
from cache_service.errors import DataLoss
from proto import cache_pb2 as pb


def cut(data: bytes | Sequence[bytes], chunk_bytes: int) -> list[bytes]:
    """The caller's chunks (or one bytes object), each cut to at most `chunk_bytes`: a chosen
    chunk larger than that (a Mamba state of a real model is tens of MiB) is cut too, since the
    service refuses chunks over its limit; the reader joins the pieces back, so the boundaries
    the caller chose still hash the same."""
    pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    return [c for piece in pieces for c in hashing.split(piece, chunk_bytes)]


def manifest(key: pb.ConversationKey, version: int, incarnation: str, chunks: Sequence[bytes],
             digests: Sequence[bytes], lease: pb.Lease | None) -> pb.StateManifest:
    out = pb.StateManifest(key=key, version=version, incarnation=incarnation, chunks=_refs(chunks, digests))
    if lease is not None:
        out.lease_token, out.lease_proof = lease.token, lease.proof
    return out


def prefix_manifest(prefix: pb.PrefixStateKey, chunks: Sequence[bytes], digests: Sequence[bytes]) -> pb.StateManifest:
    """A prefix checkpoint's manifest: no conversation, no version, no lease."""
    return pb.StateManifest(prefix=prefix, chunks=_refs(chunks, digests))


def missing_request(manifest: pb.StateManifest, digests: Sequence[bytes]) -> pb.MissingChunksRequest:
    """Which of the manifest's chunks does the tier lack, in the entry's own namespace."""
    request = pb.MissingChunksRequest(digests=list(dict.fromkeys(digests)))
    if manifest.HasField("prefix"):
        request.prefix.CopyFrom(manifest.prefix)
    else:
        request.key.CopyFrom(manifest.key)
    return request


def _refs(chunks: Sequence[bytes], digests: Sequence[bytes]) -> list[pb.ChunkRef]:
    return [pb.ChunkRef(digest=d, size=len(c)) for d, c in zip(digests, chunks, strict=True)]


async def put_requests(manifest: pb.StateManifest, chunks: Sequence[bytes], digests: Sequence[bytes],
                       send: set[bytes]) -> AsyncIterator[pb.PutStateRequest]:
    """The manifest, then each chunk in `send` once."""
    yield pb.PutStateRequest(manifest=manifest)
    pending = set(send)
    for digest, chunk in zip(digests, chunks, strict=True):
        if digest in pending:
            pending.discard(digest)
            yield pb.PutStateRequest(chunk=pb.Chunk(digest=digest, data=bytes(chunk)))


async def read_verified(replies: AsyncIterable[pb.GetStateResponse]) -> tuple[int, bytes]:
    """(version, bytes) of a GetState stream; DataLoss for a corrupted chunk or a short stream."""
    manifest, data = await read_entry(replies)
    return manifest.version, data


async def read_entry(replies: AsyncIterable[pb.GetStateResponse]) -> tuple[pb.StateManifest, bytes]:
    """(manifest, bytes) of a GetState stream; DataLoss for a corrupted chunk or a short stream."""
    head, parts = None, []
    async for reply in replies:
        if reply.HasField("manifest"):
            head = reply.manifest
            continue
        ref = head.chunks[len(parts)]
        if reply.chunk.digest != ref.digest or await asyncio.to_thread(hashing.sha256, reply.chunk.data) != ref.digest:
            raise DataLoss(f"state chunk #{len(parts)} arrived corrupted")
        parts.append(reply.chunk.data)
    if head is None or len(parts) != len(head.chunks):
        raise DataLoss("state stream ended early")
    return head, b"".join(parts)
