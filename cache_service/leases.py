"""Lease proofs: what a lease holder presents besides its fencing token.

A fencing token alone is a small counter: anyone can guess it, and the same number is
a valid token of many conversations. So AcquireLease also returns a proof

    proof = incarnation (8 bytes) ‖ HMAC-SHA256(service key, "lease/v1" ‖ conv hash ‖ incarnation ‖ token)[:16]

  - conv hash: sha256 over (salt, id), so a proof is bound to its conversation *and* salt;
  - incarnation: random per life of the conversation's fence (it changes after a delete
    or once the fence expired), so a proof never outlives the lease history it came from;
  - the service key lives in Redis (created once, kept by the AOF), so every service
    process sharing that Redis, and a restarted one, verifies the same proofs.

The service checks the MAC before touching Redis: a forged, guessed or borrowed
(token, proof) gets `lease_lost` with one fixed message, whatever the number. Only a
genuine proof reaches the Lua check, where the incarnation and the token must be the
current lease's (`stale_fence` then tells a real holder that it was superseded).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from cache_service import errors

INCARNATION_BYTES = 8
MAC_BYTES = 16
PROOF_BYTES = INCARNATION_BYTES + MAC_BYTES
KEY_BYTES = 32
_DOMAIN = b"hybridserve/lease/v1\0"
INVALID_MESSAGE = "the lease token and proof are not a live lease of this conversation"


def new_incarnation() -> str:
    """Hex, as Redis stores it and Lua compares it."""
    return secrets.token_hex(INCARNATION_BYTES)


@dataclass(frozen=True)
class Fence:
    """A verified (token, incarnation): the proof matched this conversation."""

    token: int
    incarnation: str


class LeaseSigner:
    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"lease key must be {KEY_BYTES} bytes")
        self._key = key

    def _mac(self, conv_hash: str, incarnation: bytes, token: int) -> bytes:
        material = _DOMAIN + conv_hash.encode() + incarnation + token.to_bytes(8, "big")
        return hmac.new(self._key, material, hashlib.sha256).digest()[:MAC_BYTES]

    def proof(self, conv_hash: str, incarnation: str, token: int) -> bytes:
        raw = bytes.fromhex(incarnation)
        return raw + self._mac(conv_hash, raw, token)

    def verify(self, conv_hash: str, token: int, proof: bytes) -> Fence:
        """The fence the proof stands for; LeaseLost (one message for all cases) if it
        is not a proof of `token` on this conversation."""
        if len(proof) != PROOF_BYTES or not 0 < token < 1 << 64:
            raise errors.LeaseLost(INVALID_MESSAGE)
        raw, mac = proof[:INCARNATION_BYTES], proof[INCARNATION_BYTES:]
        if not hmac.compare_digest(mac, self._mac(conv_hash, raw, token)):
            raise errors.LeaseLost(INVALID_MESSAGE)
        return Fence(token, raw.hex())
