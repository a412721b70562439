"""Typed errors of the cache service, shared by the server and the client.

The server raises these; one decorator in the servicer turns them into a gRPC status
code plus trailing metadata ("hs-reason" and a few "hs-*" details); the client turns
the status back into the same exception class. One table, both directions.
"""

from __future__ import annotations

import enum

import grpc

REASON_KEY = "hs-reason"
DETAIL_PREFIX = "hs-"


class Reason(enum.Enum):
    NOT_FOUND = "not_found"
    INVALID_ARGUMENT = "invalid_argument"
    LEASE_HELD = "lease_held"
    LEASE_LOST = "lease_lost"
    STALE_FENCE = "stale_fence"
    VERSION_CONFLICT = "version_conflict"
    MISSING_CHUNKS = "missing_chunks"
    DATA_LOSS = "data_loss"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ALREADY_EXISTS = "already_exists"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAUTHENTICATED = "unauthenticated"
    INTERRUPTED = "interrupted"
    STORAGE_FULL = "storage_full"


class CacheError(Exception):
    """Base class; `details` travel as trailing metadata (string values)."""

    reason: Reason = Reason.UNAVAILABLE
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, **details: str | int):
        super().__init__(message)
        self.message = message
        self.details = {k: str(v) for k, v in details.items()}

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        pairs = [(REASON_KEY, self.reason.value)]
        pairs += [(DETAIL_PREFIX + k.replace("_", "-"), v) for k, v in self.details.items()]
        return tuple(pairs)


class NotFound(CacheError):
    """Unknown conversation (a wrong salt looks exactly like this), or tier entry."""

    reason, code = Reason.NOT_FOUND, grpc.StatusCode.NOT_FOUND


class InvalidArgument(CacheError):
    reason, code = Reason.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT


class LeaseHeld(CacheError):
    """Another holder has the conversation; details: expires_in_ms (never who holds it)."""

    reason, code = Reason.LEASE_HELD, grpc.StatusCode.FAILED_PRECONDITION


class LeaseLost(CacheError):
    """The caller's lease expired or was released, or the token and proof presented are
    not a lease of this conversation: it must not publish anything."""

    reason, code = Reason.LEASE_LOST, grpc.StatusCode.FAILED_PRECONDITION


class StaleFence(LeaseLost):
    """The caller's lease expired and someone else has since taken the conversation."""

    reason = Reason.STALE_FENCE


class VersionConflict(CacheError):
    """Compare-and-set on the head version lost; details: current_version."""

    reason, code = Reason.VERSION_CONFLICT, grpc.StatusCode.ABORTED


class MissingChunks(CacheError):
    """A state put referenced chunks that neither the stream nor the tier holds."""

    reason, code = Reason.MISSING_CHUNKS, grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(CacheError):
    """A stored chunk no longer matches its checksum."""

    reason, code = Reason.DATA_LOSS, grpc.StatusCode.DATA_LOSS


class Unavailable(CacheError):
    """Redis (or the service) cannot be reached; retrying is safe."""

    reason, code = Reason.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE


class AlreadyExists(CacheError):
    """ForkConversation: the target conversation already has a head."""

    reason, code = Reason.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(CacheError):
    """A configured bound is reached (staged put bytes, tier disk).
    Nothing was written; retry later or with less."""

    reason, code = Reason.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED


class StorageFull(ResourceExhausted):
    """Redis refused a write for memory (maxmemory reached, policy noeviction): nothing was
    written; reads still work. Retry once conversations expire or are deleted."""

    reason = Reason.STORAGE_FULL


class Unauthenticated(CacheError):
    """The service requires its shared secret and the call did not carry the right one."""

    reason, code = Reason.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(CacheError):
    """The call's deadline passed. Not retried: the mutation may or may not have
    happened (retry it yourself with the same holder / publish_id to find out)."""

    reason, code = Reason.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED


class Interrupted(CacheError):
    """The call ended without the service's verdict: UNKNOWN or INTERNAL (a handler that
    crashed, a connection cut mid-call), CANCELLED. Transient, like a timeout: a read may be
    repeated, a mutation may or may not have happened (repeat it with the same holder /
    publish_id to find out). The service never raises it; it only names such statuses."""

    reason, code = Reason.INTERRUPTED, grpc.StatusCode.UNKNOWN


_BY_REASON: dict[Reason, type[CacheError]] = {
    cls.reason: cls
    for cls in (NotFound, InvalidArgument, LeaseHeld, LeaseLost, StaleFence,
                VersionConflict, MissingChunks, DataLoss, Unavailable, DeadlineExceeded,
                AlreadyExists, ResourceExhausted, StorageFull, Unauthenticated, Interrupted)
}
_BY_CODE: dict[grpc.StatusCode, type[CacheError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ABORTED: VersionConflict,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    # gRPC itself refuses messages above the size limit with RESOURCE_EXHAUSTED and no
    # hs-reason: that is the caller's oversized input. The service's own bounds carry
    # hs-reason = resource_exhausted and map to ResourceExhausted above.
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidArgument,
    # No verdict: typed all the same, so that a caller catching CacheError (a lease keeper, a
    # turn asking the ledger) never dies of a raw grpc error it did not expect.
    grpc.StatusCode.UNKNOWN: Interrupted,
    grpc.StatusCode.INTERNAL: Interrupted,
    grpc.StatusCode.CANCELLED: Interrupted,
}


def from_status(code: grpc.StatusCode, message: str, metadata) -> CacheError | None:
    """The typed error for a failed RPC, or None when it is not one of ours."""
    meta = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    cls = None
    if REASON_KEY in meta:
        try:
            cls = _BY_REASON[Reason(meta[REASON_KEY])]
        except ValueError:
            cls = None  # a reason from a newer server: fall back to the status code
    cls = cls or _BY_CODE.get(code)
    if cls is None:
        return None
    details = {
        k[len(DETAIL_PREFIX):].replace("-", "_"): v
        for k, v in meta.items()
        if k.startswith(DETAIL_PREFIX) and k != REASON_KEY
    }
    return cls(message, **details)
