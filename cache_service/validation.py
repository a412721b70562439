"""Input validation: every request is checked here before anything touches Redis.

Each function raises InvalidArgument with a message naming the field, so a bad
request is a 4xx-class status with a reason and never a partial write.
"""

from __future__ import annotations

import re

from cache_service.config import Limits
from cache_service.errors import InvalidArgument
from cache_service.keys import ConversationKeys
from proto import cache_pb2 as pb
from proto.contract import TIER_HOLDER, ConversationRef

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_INCARNATION_HEX = re.compile(r"[0-9a-f]{16}")
_PREFIX_NAME = re.compile(r"[0-9a-f]{32}")
_SCOPE_TAG = re.compile(r"[0-9a-f]{16}")
DIGEST_BYTES = 32
ATTEMPT_KEY_BYTES = (16, 64)


def identifier(value: str, field: str, limits: Limits, *, required: bool = True) -> str:
    size = len(value.encode())
    if required and size == 0:
        raise InvalidArgument(f"{field} must not be empty")
    if size > limits.max_id_bytes:
        raise InvalidArgument(f"{field} is {size} bytes, over the limit of {limits.max_id_bytes}")
    return value


def conversation(key: pb.ConversationKey, limits: Limits) -> ConversationKeys:
    identifier(key.conversation_id, "key.conversation_id", limits)
    identifier(key.cache_salt, "key.cache_salt", limits, required=False)
    return ConversationKeys.of(ConversationRef(key.conversation_id, key.cache_salt))


def lease_ttl(value: int, limits: Limits) -> int:
    if not limits.min_ttl_ms <= value <= limits.max_lease_ttl_ms:
        raise InvalidArgument(f"ttl_ms must be in [{limits.min_ttl_ms}, {limits.max_lease_ttl_ms}] "
                              f"(renew a longer lease), got {value}")
    return value


def attempt_key(value: bytes) -> bytes:
    low, high = ATTEMPT_KEY_BYTES
    if value and not low <= len(value) <= high:
        raise InvalidArgument(f"attempt_key must be {low}..{high} random bytes (or empty)")
    return value


def token(value: int, field: str = "lease_token") -> int:
    if value <= 0:
        raise InvalidArgument(f"{field} must be a token returned by AcquireLease")
    return value


def publish(req: pb.PublishTurnRequest, limits: Limits) -> ConversationKeys:
    keys = conversation(req.key, limits)
    token(req.lease_token)
    identifier(req.publish_id, "publish_id", limits)
    identifier(req.owner_replica, "owner_replica", limits, required=False)
    if not _SHA256_HEX.fullmatch(req.tokens_sha256):
        raise InvalidArgument("tokens_sha256 must be 64 lowercase hex digits")
    turn = req.turn
    if not turn.token_ids:
        raise InvalidArgument("turn.token_ids must not be empty: a turn commits at least one token")
    if len(turn.token_ids) > limits.max_token_ids_per_turn:
        raise InvalidArgument(f"turn has {len(turn.token_ids)} token ids, over the limit of "
                              f"{limits.max_token_ids_per_turn}")
    if len(turn.messages) > limits.max_messages_per_turn:
        raise InvalidArgument(f"turn has {len(turn.messages)} messages, over the limit of "
                              f"{limits.max_messages_per_turn}")
    content = 0
    for i, message in enumerate(turn.messages):
        if not message.role:
            raise InvalidArgument(f"turn.messages[{i}].role must not be empty")
        content += len(message.role.encode()) + len(message.content.encode())
    if content > limits.max_turn_content_bytes:
        raise InvalidArgument(f"turn messages hold {content} bytes, over the limit of "
                              f"{limits.max_turn_content_bytes}")
    # The stored entry must always fit a ReadLedger reply: bound what is serialized,
    # not only what the known fields declare (unknown fields are dropped on parse).
    if turn.ByteSize() > limits.max_turn_bytes:
        raise InvalidArgument(f"turn serializes to {turn.ByteSize()} bytes, over the limit of "
                              f"{limits.max_turn_bytes}")
    if req.committed_tokens < len(turn.token_ids):
        raise InvalidArgument("committed_tokens must count the committed history including this turn")
    return keys


def digests(values, field: str, limits: Limits) -> list[bytes]:
    values = list(values)
    if len(values) > limits.max_chunks_per_state:
        raise InvalidArgument(f"{field} has {len(values)} entries, over the limit of "
                              f"{limits.max_chunks_per_state}")
    for i, digest in enumerate(values):
        if len(digest) != DIGEST_BYTES:
            raise InvalidArgument(f"{field}[{i}] must be a 32-byte sha256 digest, got {len(digest)} bytes")
    return values


def manifest(m: pb.StateManifest, limits: Limits) -> ConversationKeys:
    keys = conversation(m.key, limits)
    if m.version <= 0:
        raise InvalidArgument("manifest.version must be the committed head version (> 0)")
    if not _INCARNATION_HEX.fullmatch(m.incarnation):
        raise InvalidArgument("manifest.incarnation must be the exported head's incarnation "
                              "(Head.incarnation, 16 hex digits)")
    _chunks(m, limits)
    return keys


def prefix_manifest(m: pb.StateManifest, limits: Limits) -> pb.PrefixStateKey:
    """A prefix checkpoint's manifest: its key (with tokens), no conversation field."""
    _no_conversation(m.key.conversation_id or m.key.cache_salt or m.version or m.incarnation
                     or m.lease_token or m.lease_proof, "manifest")
    key = prefix_state(m.prefix, "manifest.prefix")
    if key.tokens <= 0:
        raise InvalidArgument("manifest.prefix.tokens must be the prefix's length in tokens (> 0)")
    _chunks(m, limits)
    return key


def prefix_state(key: pb.PrefixStateKey, field: str) -> pb.PrefixStateKey:
    if key.scope and not _SCOPE_TAG.fullmatch(key.scope):
        raise InvalidArgument(f"{field}.scope must be empty or a scope tag: 16 lowercase hex digits")
    if not _PREFIX_NAME.fullmatch(key.name):
        raise InvalidArgument(f"{field}.name must be a prefix name: 32 lowercase hex digits")
    return key


def prefix_request(request: pb.GetStateRequest | pb.MissingChunksRequest) -> pb.PrefixStateKey:
    """The prefix of a read or a MissingChunks: no conversation key (nor version) beside it."""
    _no_conversation(request.key.conversation_id or request.key.cache_salt or getattr(request, "version", 0),
                     "request")
    return prefix_state(request.prefix, "prefix")


def _no_conversation(present: object, what: str) -> None:
    if present:
        raise InvalidArgument(f"a {what} naming a prefix must leave the conversation fields (key, version, "
                              "incarnation, lease) empty")


def _chunks(m: pb.StateManifest, limits: Limits) -> None:
    if not m.chunks:
        raise InvalidArgument("manifest.chunks must not be empty")
    digests((c.digest for c in m.chunks), "manifest.chunks", limits)
    sizes: dict[bytes, int] = {}
    for i, chunk in enumerate(m.chunks):
        if not 0 < chunk.size <= limits.max_chunk_bytes:
            raise InvalidArgument(f"manifest.chunks[{i}].size must be in [1, {limits.max_chunk_bytes}]")
        if sizes.setdefault(chunk.digest, chunk.size) != chunk.size:
            raise InvalidArgument(f"manifest.chunks[{i}] repeats a digest with another size "
                                  f"({chunk.size} vs {sizes[chunk.digest]})")


def prefix_names(values, field: str, bound: int) -> list[str]:
    """Prefix-index names (proto.contract.message_prefix_digests entries)."""
    values = list(values)
    if len(values) > bound:
        raise InvalidArgument(f"{field} has {len(values)} entries, over the limit of {bound}")
    for i, name in enumerate(values):
        if not _PREFIX_NAME.fullmatch(name):
            raise InvalidArgument(f"{field}[{i}] must be a prefix name: 32 lowercase hex digits")
    return values


def prefix_scope(value: str) -> str:
    """A prefix-index scope tag (proto.contract.prefix_scope_tag), or empty."""
    if value and not _SCOPE_TAG.fullmatch(value):
        raise InvalidArgument("scope must be empty or a scope tag: 16 lowercase hex digits")
    return value


def replica(value: str, limits: Limits) -> str:
    """A replica announcing or forgetting prefixes: never the state tier's holder name, which only
    the service itself announces (a client could otherwise claim or withdraw the tier's copies)."""
    identifier(value, "replica", limits)
    if value == TIER_HOLDER:
        raise InvalidArgument(f"replica {TIER_HOLDER!r} names the state tier: only the service announces it")
    return value


def announce_prefixes(req: pb.AnnouncePrefixesRequest, limits: Limits) -> list[tuple[str, int]]:
    replica(req.replica, limits)
    prefix_names((e.name for e in req.entries), "entries", limits.max_prefix_entries)
    for i, entry in enumerate(req.entries):
        if entry.tokens <= 0:
            raise InvalidArgument(f"entries[{i}].tokens must be the prefix's length in tokens (> 0)")
    return [(e.name, e.tokens) for e in req.entries]
