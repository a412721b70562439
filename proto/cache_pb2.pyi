from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConversationKey(_message.Message):
    __slots__ = ("conversation_id", "cache_salt")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    cache_salt: str
    def __init__(self, conversation_id: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("key", "holder", "ttl_ms", "attempt_key")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    holder: str
    ttl_ms: int
    attempt_key: bytes
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., holder: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., attempt_key: _Optional[bytes] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("holder", "token", "expires_at_ms", "proof", "head")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    holder: str
    token: int
    expires_at_ms: int
    proof: bytes
    head: Head
    def __init__(self, holder: _Optional[str] = ..., token: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., proof: _Optional[bytes] = ..., head: _Optional[_Union[Head, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("key", "token", "ttl_ms", "lease_proof")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROOF_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    token: int
    ttl_ms: int
    lease_proof: bytes
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., token: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., lease_proof: _Optional[bytes] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("key", "token", "lease_proof")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROOF_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    token: int
    lease_proof: bytes
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., token: _Optional[int] = ..., lease_proof: _Optional[bytes] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetHeadRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ...) -> None: ...

class Head(_message.Message):
    __slots__ = ("version", "turn", "committed_tokens", "tokens_sha256", "owner_replica", "tier_version", "updated_at_ms", "incarnation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SHA256_FIELD_NUMBER: _ClassVar[int]
    OWNER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    TIER_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    turn: int
    committed_tokens: int
    tokens_sha256: str
    owner_replica: str
    tier_version: int
    updated_at_ms: int
    incarnation: str
    def __init__(self, version: _Optional[int] = ..., turn: _Optional[int] = ..., committed_tokens: _Optional[int] = ..., tokens_sha256: _Optional[str] = ..., owner_replica: _Optional[str] = ..., tier_version: _Optional[int] = ..., updated_at_ms: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class LedgerTurn(_message.Message):
    __slots__ = ("turn", "messages", "token_ids", "publish_id", "committed_at_ms", "result")
    TURN_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    turn: int
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    publish_id: str
    committed_at_ms: int
    result: TurnResult
    def __init__(self, turn: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., publish_id: _Optional[str] = ..., committed_at_ms: _Optional[int] = ..., result: _Optional[_Union[TurnResult, _Mapping]] = ...) -> None: ...

class TurnResult(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "tool_format", "sent")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tool_format: str
    sent: SentReply
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., tool_format: _Optional[str] = ..., sent: _Optional[_Union[SentReply, _Mapping]] = ...) -> None: ...

class SentReply(_message.Message):
    __slots__ = ("content", "tool_calls")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[SentToolCall]
    def __init__(self, content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[SentToolCall, _Mapping]]] = ...) -> None: ...

class SentToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class PublishTurnRequest(_message.Message):
    __slots__ = ("key", "lease_token", "expected_version", "turn", "committed_tokens", "tokens_sha256", "owner_replica", "release_lease", "publish_id", "lease_proof")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SHA256_FIELD_NUMBER: _ClassVar[int]
    OWNER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROOF_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    lease_token: int
    expected_version: int
    turn: LedgerTurn
    committed_tokens: int
    tokens_sha256: str
    owner_replica: str
    release_lease: bool
    publish_id: str
    lease_proof: bytes
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., lease_token: _Optional[int] = ..., expected_version: _Optional[int] = ..., turn: _Optional[_Union[LedgerTurn, _Mapping]] = ..., committed_tokens: _Optional[int] = ..., tokens_sha256: _Optional[str] = ..., owner_replica: _Optional[str] = ..., release_lease: _Optional[bool] = ..., publish_id: _Optional[str] = ..., lease_proof: _Optional[bytes] = ...) -> None: ...

class DiscardRequest(_message.Message):
    __slots__ = ("key", "lease_token", "lease_proof")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROOF_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    lease_token: int
    lease_proof: bytes
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., lease_token: _Optional[int] = ..., lease_proof: _Optional[bytes] = ...) -> None: ...

class ReadLedgerRequest(_message.Message):
    __slots__ = ("key", "from_turn", "max_turns")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FROM_TURN_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    from_turn: int
    max_turns: int
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., from_turn: _Optional[int] = ..., max_turns: _Optional[int] = ...) -> None: ...

class ReadLedgerResponse(_message.Message):
    __slots__ = ("head", "turns", "next_turn")
    HEAD_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TURN_FIELD_NUMBER: _ClassVar[int]
    head: Head
    turns: _containers.RepeatedCompositeFieldContainer[LedgerTurn]
    next_turn: int
    def __init__(self, head: _Optional[_Union[Head, _Mapping]] = ..., turns: _Optional[_Iterable[_Union[LedgerTurn, _Mapping]]] = ..., next_turn: _Optional[int] = ...) -> None: ...

class DeleteConversationRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ...) -> None: ...

class DeleteConversationResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class TransferOwnershipRequest(_message.Message):
    __slots__ = ("key", "lease_token", "expected_version", "new_owner", "lease_proof")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEW_OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROOF_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    lease_token: int
    expected_version: int
    new_owner: str
    lease_proof: bytes
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., lease_token: _Optional[int] = ..., expected_version: _Optional[int] = ..., new_owner: _Optional[str] = ..., lease_proof: _Optional[bytes] = ...) -> None: ...

class RewindConversationRequest(_message.Message):
    __slots__ = ("key", "lease_token", "lease_proof", "expected_version", "turn", "owner_replica")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROOF_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    OWNER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    lease_token: int
    lease_proof: bytes
    expected_version: int
    turn: int
    owner_replica: str
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., lease_token: _Optional[int] = ..., lease_proof: _Optional[bytes] = ..., expected_version: _Optional[int] = ..., turn: _Optional[int] = ..., owner_replica: _Optional[str] = ...) -> None: ...

class ForkConversationRequest(_message.Message):
    __slots__ = ("key", "new_conversation_id", "turn", "expected_version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NEW_CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    new_conversation_id: str
    turn: int
    expected_version: int
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., new_conversation_id: _Optional[str] = ..., turn: _Optional[int] = ..., expected_version: _Optional[int] = ...) -> None: ...

class ChunkRef(_message.Message):
    __slots__ = ("digest", "size")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    size: int
    def __init__(self, digest: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class MissingChunksRequest(_message.Message):
    __slots__ = ("key", "digests", "prefix")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    prefix: PrefixStateKey
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., digests: _Optional[_Iterable[bytes]] = ..., prefix: _Optional[_Union[PrefixStateKey, _Mapping]] = ...) -> None: ...

class MissingChunksResponse(_message.Message):
    __slots__ = ("digests",)
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefixStateKey(_message.Message):
    __slots__ = ("scope", "name", "tokens")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    scope: str
    name: str
    tokens: int
    def __init__(self, scope: _Optional[str] = ..., name: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("key", "version", "chunks", "incarnation", "lease_token", "lease_proof", "prefix")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROOF_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    version: int
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkRef]
    incarnation: str
    lease_token: int
    lease_proof: bytes
    prefix: PrefixStateKey
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., version: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[ChunkRef, _Mapping]]] = ..., incarnation: _Optional[str] = ..., lease_token: _Optional[int] = ..., lease_proof: _Optional[bytes] = ..., prefix: _Optional[_Union[PrefixStateKey, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("digest", "data")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    data: bytes
    def __init__(self, digest: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutStateRequest(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: StateManifest
    chunk: Chunk
    def __init__(self, manifest: _Optional[_Union[StateManifest, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PutStateResponse(_message.Message):
    __slots__ = ("total_bytes", "chunks_sent", "chunks_reused", "head")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SENT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    chunks_sent: int
    chunks_reused: int
    head: Head
    def __init__(self, total_bytes: _Optional[int] = ..., chunks_sent: _Optional[int] = ..., chunks_reused: _Optional[int] = ..., head: _Optional[_Union[Head, _Mapping]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("key", "version", "prefix")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    key: ConversationKey
    version: int
    prefix: PrefixStateKey
    def __init__(self, key: _Optional[_Union[ConversationKey, _Mapping]] = ..., version: _Optional[int] = ..., prefix: _Optional[_Union[PrefixStateKey, _Mapping]] = ...) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: StateManifest
    chunk: Chunk
    def __init__(self, manifest: _Optional[_Union[StateManifest, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PrefixEntry(_message.Message):
    __slots__ = ("name", "tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tokens: int
    def __init__(self, name: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class AnnouncePrefixesRequest(_message.Message):
    __slots__ = ("replica", "entries", "scope")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    replica: str
    entries: _containers.RepeatedCompositeFieldContainer[PrefixEntry]
    scope: str
    def __init__(self, replica: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[PrefixEntry, _Mapping]]] = ..., scope: _Optional[str] = ...) -> None: ...

class AnnouncePrefixesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForgetPrefixesRequest(_message.Message):
    __slots__ = ("replica", "names", "scope")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    replica: str
    names: _containers.RepeatedScalarFieldContainer[str]
    scope: str
    def __init__(self, replica: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., scope: _Optional[str] = ...) -> None: ...

class ForgetPrefixesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FindPrefixRequest(_message.Message):
    __slots__ = ("names", "scope")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    scope: str
    def __init__(self, names: _Optional[_Iterable[str]] = ..., scope: _Optional[str] = ...) -> None: ...

class PrefixHolder(_message.Message):
    __slots__ = ("replica", "tokens", "index")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    replica: str
    tokens: int
    index: int
    def __init__(self, replica: _Optional[str] = ..., tokens: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class FindPrefixResponse(_message.Message):
    __slots__ = ("index", "holders")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    index: int
    holders: _containers.RepeatedCompositeFieldContainer[PrefixHolder]
    def __init__(self, index: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[PrefixHolder, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("tier_memory_bytes", "tier_disk_bytes", "tier_budget_bytes", "tier_entries", "tier_chunks", "tier_spills", "tier_disk_reads", "tier_checksum_failures", "rpc_counts", "rpc_errors", "tier_staged_bytes", "prefix_index_names", "tier_prefix_entries", "tier_prefix_bytes")
    class RpcCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RpcErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIER_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TIER_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TIER_SPILLS_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_READS_FIELD_NUMBER: _ClassVar[int]
    TIER_CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RPC_COUNTS_FIELD_NUMBER: _ClassVar[int]
    RPC_ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIER_STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_INDEX_NAMES_FIELD_NUMBER: _ClassVar[int]
    TIER_PREFIX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TIER_PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier_memory_bytes: int
    tier_disk_bytes: int
    tier_budget_bytes: int
    tier_entries: int
    tier_chunks: int
    tier_spills: int
    tier_disk_reads: int
    tier_checksum_failures: int
    rpc_counts: _containers.ScalarMap[str, int]
    rpc_errors: _containers.ScalarMap[str, int]
    tier_staged_bytes: int
    prefix_index_names: int
    tier_prefix_entries: int
    tier_prefix_bytes: int
    def __init__(self, tier_memory_bytes: _Optional[int] = ..., tier_disk_bytes: _Optional[int] = ..., tier_budget_bytes: _Optional[int] = ..., tier_entries: _Optional[int] = ..., tier_chunks: _Optional[int] = ..., tier_spills: _Optional[int] = ..., tier_disk_reads: _Optional[int] = ..., tier_checksum_failures: _Optional[int] = ..., rpc_counts: _Optional[_Mapping[str, int]] = ..., rpc_errors: _Optional[_Mapping[str, int]] = ..., tier_staged_bytes: _Optional[int] = ..., prefix_index_names: _Optional[int] = ..., tier_prefix_entries: _Optional[int] = ..., tier_prefix_bytes: _Optional[int] = ...) -> None: ...
