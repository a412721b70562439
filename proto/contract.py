"""What workers and the cache service must agree on, bit for bit, owned by neither side.

- the name of a conversation: a salted hash of (conversation_id, cache_salt), carried as a
  `ConversationRef`;
- the digest of a conversation's committed token ids (the head's `tokens_sha256`);
- the name of a state chunk (sha256 of its bytes);
- the names of a chat's message prefixes (the prefix index's keys), and the holder name of the
  state tier among that index's holders;
- the identity of a model: what makes the bits of its state differ across machines.

Pure standard library: the service imports this without torch.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any
from dataclasses import asdict, dataclass, field

_DOMAIN = b"hybridserve/conversation/v1\0"


def conversation_key(conversation_id: str, cache_salt: str) -> str:
    """128-bit hex digest naming a conversation; stable across processes and versions.

    Length-prefixed so that no (id, salt) pair can be re-split into another: a wrong salt is
    another, empty conversation (a miss), never someone else's state."""
    salt = cache_salt.encode()
    ident = conversation_id.encode()
    material = _DOMAIN + len(salt).to_bytes(4, "big") + salt + len(ident).to_bytes(4, "big") + ident
    return hashlib.sha256(material).hexdigest()[:32]


_PREFIX_DOMAIN = b"hybridserve/message-prefix/v1\0"


def _framed(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(4, "big") + data


def message_prefix_digests(scope: str, messages: list[dict[str, str]]) -> list[str]:
    """Names of a chat's message prefixes within a cache scope: entry k names messages[:k + 1].

    The prefix index (which replica holds the state of which prefix) is keyed by these, so a
    router finds the replica for a request from its messages alone, without a tokenizer. They
    are hints: the worker attaches a prefix only where the token ids match exactly. Chained
    (entry k hashes entry k - 1 and message k) and framed like `conversation_key`, so no two
    (scope, messages) split alike; another scope (salt, API key) names other prefixes."""
    state = hashlib.sha256(_PREFIX_DOMAIN + _framed(scope)).digest()
    names = []
    for message in messages:
        part = _framed(message.get("role", "")) + _framed(message.get("content", ""))
        for field_name in ("tool_calls", "tool_call_id"):  # absent from plain messages: their names stay
            if message.get(field_name):
                part += _framed(field_name) + _framed(_canonical(message[field_name]))
        state = hashlib.sha256(state + part).digest()
        names.append(state.hex()[:32])
    return names


_SCOPE_TAG_DOMAIN = b"hybridserve/prefix-scope/v1\0"


def prefix_scope_tag(scope: str) -> str:
    """Where a scope's prefix names live in the index (16 lowercase hex): the cache service keys
    them by it, so one scope's names share one Redis Cluster slot and scopes spread over the
    shards. A digest of its own, not the names' chain root: the tag reveals nothing that would
    let one test guesses of a scope's messages against stored names."""
    return hashlib.sha256(_SCOPE_TAG_DOMAIN + _framed(scope)).hexdigest()[:16]


# The holder the prefix index names for the cache service's state tier (a prefix checkpoint
# exported there, cache.proto PrefixStateKey): only the service announces or withdraws it; a
# client naming it as its replica is refused.
TIER_HOLDER = "~tier"


def tools_scope(scope: str, tools: Sequence[Any]) -> str:
    """The prefix-index scope of a request with function tools: the template renders them into
    the prompt, so chats with other tools share no prefix."""
    if not tools:
        return scope
    return f"{scope}\x00tools:{hashlib.sha256(_canonical(list(tools)).encode()).hexdigest()[:32]}"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ConversationRef:
    """A conversation: its id under a cache_salt. The pair is one name, never two loose strings:
    the same id under another salt is another conversation (an empty one, a miss). `key` is
    its `conversation_key`, computed once here."""

    id: str
    salt: str = ""
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", conversation_key(self.id, self.salt))

    def fork(self, new_id: str) -> "ConversationRef":
        """The conversation `new_id` under the same salt (a fork's target)."""
        return ConversationRef(new_id, self.salt)


def token_bytes(token_ids: Iterable[int]) -> bytes:
    """Token ids as the bytes their digests hash: uint32 little endian, 4 bytes per token."""
    ids = array("I", token_ids)
    assert ids.itemsize == 4, "array('I') is not 32-bit on this platform"
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


def tokens_digest(token_ids: Iterable[int]) -> str:
    """sha256 hex of the committed token ids as uint32 little endian."""
    return hashlib.sha256(token_bytes(token_ids)).hexdigest()


def chunk_digest(data: bytes | bytearray | memoryview) -> str:
    """The name of a state chunk: sha256 hex of its bytes."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ModelIdentity:
    """A head's state only fits an engine whose identity is equal: same weights and config,
    same dtype, same torch (kernels change between versions) and same device kind (CPU
    model / GPU name: reductions differ across them)."""

    weights_digest: str
    config_digest: str
    dtype: str
    torch_version: str
    device_kind: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelIdentity:
        return cls(**{k: str(data[k]) for k in cls.__dataclass_fields__})
