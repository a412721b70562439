"""Digests shared by the service, its client and the engine's exporters."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable


def sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def tokens_sha256(token_ids: Iterable[int]) -> str:
    """The head's `tokens_sha256`: sha256 hex of the committed token ids as uint32 LE."""
    ids = array("I", token_ids)
    assert ids.itemsize == 4, "array('I') is not 32-bit on this platform"
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).hexdigest()


def split(data: bytes | bytearray | memoryview, chunk_bytes: int) -> list[memoryview]:
    """Fixed-size chunks (views, no copies); the last one may be shorter."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = memoryview(data)
    return [view[i:i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]
