"""Digests shared by the service, its client and the engine's exporters."""

from __future__ import annotations

import hashlib



def sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def split(data: bytes | bytearray | memoryview, chunk_bytes: int) -> list[memoryview]:
    """Fixed-size chunks (views, no copies); the last one may be shorter."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = memoryview(data)
    return [view[i:i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]
