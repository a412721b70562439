"""Frames between a worker replica and its engine host: an 8-byte big-endian length (a long
conversation's head export on a large model passes 4 GiB), then a pickled dict of plain values
(str, int, float, bool, bytes, lists, dicts). Both ends are our own code on one machine, started
together: pickle is safe here and moves bytes without copies."""

from __future__ import annotations

import pickle
import struct
from typing import Any, BinaryIO

_LENGTH = struct.Struct(">Q")
HEADER_BYTES = _LENGTH.size


def encode(message: dict[str, Any]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return header(len(body)) + body


def header(body_bytes: int) -> bytes:
    return _LENGTH.pack(body_bytes)


def body_length(header: bytes) -> int:
    return _LENGTH.unpack(header)[0]


def decode(body: bytes) -> dict[str, Any]:
    return pickle.loads(body)


def read(stream: BinaryIO) -> dict[str, Any] | None:
    """The next frame of a blocking stream; None at its end."""
    header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        return None
    body = stream.read(body_length(header))
    return decode(body)
