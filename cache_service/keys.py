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


class PrefixKeys:
    """The prefix index: one hash per prefix name (field replica -> tokens, with a TTL) and one
    sorted set of the live names (score: expiry, Unix ms) that counts them without a SCAN.

    One hash tag for the whole index: its scripts touch many names at once, which a Redis
    Cluster allows only within one slot (the index is small: hints, not state)."""

    PREFIX = f"{NAMESPACE}:prefix:{{index}}"
    live = f"{PREFIX}:live"

    @classmethod
    def name(cls, name: str) -> str:
        return f"{cls.PREFIX}:name:{name}"


# The service's lease-proof key (leases.py): created once, shared by every service
# process using this Redis.
LEASE_KEY = f"{NAMESPACE}:lease-proof-key"
