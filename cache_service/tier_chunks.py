"""The names the state tier stores chunks under, shared by its conversation entries (tier.py)
and its prefix checkpoints (prefix_tier.py)."""

from __future__ import annotations

from dataclasses import dataclass

ChunkKey = tuple[str, bytes]  # (namespace: conversation hash or prefix_tier.namespace, sha256 digest)


@dataclass(frozen=True)
class ChunkRef:
    digest: bytes
    size: int
