"""Conversation identity and the Redis key layout (see README.md for the full schema).

A conversation is (conversation_id, cache_salt): a `ConversationRef`. Redis never sees
either: every key of a conversation is derived from sha256 over both (`ref.key`),
length-prefixed so that no (id, salt) pair can be re-split into another. A wrong salt therefore addresses a
different, empty conversation: a miss, never someone else's state.

All keys of one conversation share the hash tag {<conv hash>} so the Lua scripts
that touch several of them stay valid on a Redis Cluster (one slot per conversation).
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.contract import ConversationRef  # the shared contract

NAMESPACE = "hs:v1"


@dataclass(frozen=True)
class ConversationKeys:
    """The Redis keys of one conversation."""

    conv_hash: str

    @classmethod
    def of(cls, ref: ConversationRef) -> "ConversationKeys":
        return cls(ref.key)

    def _key(self, suffix: str) -> str:
        return f"{NAMESPACE}:conv:{{{self.conv_hash}}}:{suffix}"

    @property
    def head(self) -> str:
        return self._key("head")

    @property
    def lease(self) -> str:
        return self._key("lease")

    @property
    def ledger(self) -> str:
        return self._key("ledger")

    @property
    def marks(self) -> str:
        return self._key("marks")

    @property
    def fence(self) -> str:
        return self._key("fence")


@dataclass(frozen=True)
class PrefixKeys:
    """The prefix index of one scope: one hash per prefix name (field replica ->
    "tokens:expires_ms") and one sorted set of the scope's live names (score: expiry, Unix ms)
    that counts them without a SCAN.

    The scope's tag (proto.contract.prefix_scope_tag) is the hash tag: a scope's scripts touch
    many of its names at once, which a Redis Cluster allows only within one slot, and different
    scopes land on different slots, so the index spreads over the shards. The empty tag (a
    client that names no scope) is the slot `{index}` every name had before scopes."""

    scope: str = ""

    @property
    def _prefix(self) -> str:
        return f"{NAMESPACE}:prefix:{{index:{self.scope}}}" if self.scope else f"{NAMESPACE}:prefix:{{index}}"

    @property
    def live(self) -> str:
        return f"{self._prefix}:live"

    def name(self, name: str) -> str:
        return f"{self._prefix}:name:{name}"


# The scopes with live names (member: scope tag, score: its latest expiry): what Stats sums the
# live names over, a key of its own (one slot) written beside each announce.
PREFIX_SCOPES = f"{NAMESPACE}:prefix-scopes"

# The service's lease-proof key (leases.py): created once, shared by every service
# process using this Redis.
LEASE_KEY = f"{NAMESPACE}:lease-proof-key"
