"""The export's wire format, shared by the exporting and the importing side.

    header = JSON (sorted keys, compact) + sha256 of that JSON (32 bytes)
    chunk kinds: kv (a full KV block), kv_tail (the partial last block), state (a Mamba slot)

A state tier entry is one export cut into parts (`pack_export` / `unpack_export`), so that
unchanged KV blocks are the same chunks from one version to the next (the tier stores and
sends each once):

    part 0: u32 length (little endian) | JSON index {"header": n, "chunks": [[digest, size], ...]}
    part 1: the export header (self-checking)      parts 2..: the export's chunks, in order

The tier stores the parts concatenated; `unpack_export` reads that blob back.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from proto.contract import ModelIdentity
from workers.errors import CorruptStateError

if TYPE_CHECKING:
    from workers.engine import LLMEngine

FORMAT_VERSION = 2
_TRAILER = 32
_INDEX_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class ExportedHead:
    header: bytes
    chunks: tuple[tuple[str, bytes], ...]  # (digest, bytes) in header order

    @property
    def digests(self) -> list[str]:
        return [d for d, _ in self.chunks]


class ChunkKind(str, Enum):
    """A str enum: the header names kinds by these values, so they compare to the JSON as is."""

    KV = "kv"
    KV_TAIL = "kv_tail"
    STATE = "state"


def engine_layout(engine: LLMEngine) -> dict[str, Any]:
    kv, st = engine.kv_layout, engine.state_layout
    return {
        "block_size": kv.block_size,
        "kv": [kv.num_layers, kv.n_kv_heads, kv.head_dim],
        "kv_dtype": str(kv.dtype),
        "mamba": [st.num_layers, st.conv_dim, st.conv_width, st.n_heads, st.head_dim, st.d_state],
        "state_dtype": str(st.dtype),
    }


def messages_digest(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def seal_header(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return raw + hashlib.sha256(raw).digest()


def parse_header(header: bytes, expected_format: int | str = FORMAT_VERSION) -> dict[str, Any]:
    """The sealed header's JSON, if its checksum holds and it is of `expected_format` (another
    backend's exports have their own: a head never crosses backends)."""
    raw, trailer = header[:-_TRAILER], header[-_TRAILER:]
    if len(header) <= _TRAILER or hashlib.sha256(raw).digest() != trailer:
        raise CorruptStateError("the export header failed its checksum")
    try:
        parsed = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptStateError(f"unreadable export header: {e}") from e
    if not isinstance(parsed, dict) or parsed.get("format") != expected_format:
        raise CorruptStateError(f"unknown export format {parsed.get('format') if isinstance(parsed, dict) else None!r}")
    return parsed


def parse_fitting_header(header: bytes, identity: ModelIdentity, layout: dict[str, Any],
                         expected_format: int | str = FORMAT_VERSION) -> dict[str, Any]:
    """The sealed header's JSON, if it is of `expected_format` and was made by an engine of this
    model identity and cache layout (the bits fit); CorruptStateError otherwise."""
    h = parse_header(header, expected_format)
    try:
        foreign = ModelIdentity.from_dict(h["identity"])
    except (KeyError, TypeError) as e:
        raise CorruptStateError(f"malformed model identity: {e!r}") from e
    if foreign != identity:
        raise CorruptStateError(f"the export was made by another model or machine kind: {foreign} vs {identity}")
    if h.get("layout") != layout:
        raise CorruptStateError(f"cache layout differs: {h.get('layout')} vs {layout}")
    return h


def chunk_shapes(layout: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype, tuple[int, ...], tuple[int, ...]]:
    """(KV block shape, KV dtype, conv state shape, SSM state shape) of a layout."""
    layers, heads, dim = layout["kv"]
    m_layers, conv_dim, width, n_heads, head_dim, d_state = layout["mamba"]
    kv_dtype = getattr(torch, layout["kv_dtype"].removeprefix("torch."))
    return (layers, 2, layout["block_size"], heads, dim), kv_dtype, (m_layers, conv_dim, width), (
        m_layers, n_heads, head_dim, d_state)


def pack_export(exported: ExportedHead) -> list[bytes]:
    """The tier entry's parts: index, header, chunks (see the module docstring)."""
    index = json.dumps({"header": len(exported.header), "chunks": [[d, len(c)] for d, c in exported.chunks]},
                       separators=(",", ":")).encode()
    return [_INDEX_LEN.pack(len(index)) + index, exported.header, *(c for _, c in exported.chunks)]


def unpack_export(blob: bytes) -> tuple[bytes, dict[str, bytes]]:
    """(header, chunks by digest) of a tier entry; CorruptStateError if it does not add up."""
    try:
        (n,) = _INDEX_LEN.unpack_from(blob, 0)
        index = json.loads(blob[_INDEX_LEN.size : _INDEX_LEN.size + n])
        offset = _INDEX_LEN.size + n
        header = blob[offset : offset + index["header"]]
        offset += index["header"]
        chunks = {}
        for digest, size in index["chunks"]:
            chunks[digest] = blob[offset : offset + size]
            offset += size
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CorruptStateError(f"unreadable tier entry: {e!r}") from e
    if offset != len(blob):
        raise CorruptStateError("tier entry has trailing or missing bytes")
    return header, chunks
