"""Check a foreign export against this engine and parse it (any thread: checksums, parsing).

Checksums prove the bytes are what the exporter wrote; the consistency checks prove it wrote
sense (chunks covering state_len, both slot roles); identity and layout prove this engine can
use the bits. What it does not prove, that the export belongs to this engine's ledger, is
checked at install time against the adopted ledger (export_install.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from proto.contract import ModelIdentity, chunk_digest
from workers.cache.holders import SlotRole
from workers.conversation.export_format import ChunkKind, chunk_shapes, parse_fitting_header
from workers.errors import CorruptStateError


@dataclass(frozen=True)
class VerifiedHead:
    meta: dict[str, Any]
    blocks: tuple[tuple[str, torch.Tensor | None], ...]  # (digest, data or None: held by the importer)
    states: dict[SlotRole, tuple[torch.Tensor, torch.Tensor]]  # role -> (conv, ssm) of every layer


def _tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _check_consistent(h: dict[str, Any]) -> None:
    """Checksums prove the bytes are what the exporter wrote, not that it wrote sense."""
    try:
        bs, state_len, aligned = h["layout"]["block_size"], h["state_len"], h["aligned_len"]
        kinds = [c["kind"] for c in h["chunks"]]
        roles = [c.get("role") for c in h["chunks"] if c["kind"] == ChunkKind.STATE]
        problems = [
            (kinds.count(ChunkKind.KV) != state_len // bs, "full block chunks do not cover state_len"),
            (kinds.count(ChunkKind.KV_TAIL) != (1 if state_len % bs else 0), "tail chunk vs state_len"),
            (not 0 <= aligned <= state_len, "aligned_len out of range"),
            *(_prefix_problems(h, state_len, roles) if "prefix" in h else _head_problems(h, state_len, roles)),
        ]
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptStateError(f"malformed export header: {e!r}") from e
    bad = [why for failed, why in problems if failed]
    if bad:
        raise CorruptStateError("inconsistent export: " + "; ".join(bad))


def _head_problems(h: dict[str, Any], state_len: int, roles: list[str]) -> list[tuple[bool, str]]:
    return [
        (h["committed_tokens"] != state_len + 1, "state_len must be the committed length - 1"),
        # Every head holds both states: a turn continuing it copies the aligned one as well.
        (roles != [SlotRole.TERMINAL.value, SlotRole.ALIGNED.value], "slot roles"),
        (h["turn"] < 1, "turn must be >= 1"),
    ]


def _prefix_problems(h: dict[str, Any], state_len: int, roles: list[str]) -> list[tuple[bool, str]]:
    """A prefix checkpoint's state covers exactly the tokens it is named by, from its terminal
    state alone (requests attach nothing else of it)."""
    prefix = h["prefix"]
    return [
        (h["committed_tokens"] != state_len or prefix["length"] != state_len, "prefix length vs state_len"),
        (h["tokens_digest"] != prefix["digest"], "prefix digest vs tokens digest"),
        (not isinstance(prefix["scope"], str), "prefix scope"),
        (roles != [SlotRole.TERMINAL.value], "slot roles"),
        (h["aligned_len"] != 0, "a prefix checkpoint has no aligned state"),
        (h["turn"] != 0 or h["conversation"] != "", "a prefix checkpoint belongs to no conversation"),
        (state_len < 1, "empty prefix"),
    ]


def verify_export(
    header: bytes,
    chunks: Mapping[str, bytes],
    identity: ModelIdentity,
    layout: dict[str, Any],
    held: set[str] = frozenset(),
) -> VerifiedHead:
    """Check an export against this engine and parse it; `chunks` may leave out `held` ones."""
    h = parse_fitting_header(header, identity, layout)
    _check_consistent(h)
    kv_shape, kv_dtype, conv_shape, ssm_shape = chunk_shapes(layout)
    conv_bytes = torch.Size(conv_shape).numel() * 4  # Mamba states are fp32
    blocks: list[tuple[str, torch.Tensor | None]] = []
    states: dict[SlotRole, tuple[torch.Tensor, torch.Tensor]] = {}
    for c in h["chunks"]:
        digest, data = c["digest"], chunks.get(c["digest"])
        if data is None:
            if c["kind"] != ChunkKind.KV or digest not in held:
                raise CorruptStateError(f"chunk {digest[:16]} is neither in the export nor held here")
            blocks.append((digest, None))
            continue
        if len(data) != c["size"] or chunk_digest(data) != digest:
            raise CorruptStateError(f"chunk {digest[:16]} failed its checksum")
        try:
            if c["kind"] == ChunkKind.STATE:
                states[SlotRole(c["role"])] = (
                    _tensor(data[:conv_bytes], torch.float32, conv_shape),
                    _tensor(data[conv_bytes:], torch.float32, ssm_shape),
                )
            else:
                blocks.append((digest, _tensor(data, kv_dtype, kv_shape)))
        except RuntimeError as e:  # sizes that do not fit the layout
            raise CorruptStateError(f"chunk {digest[:16]} does not fit the layout: {e}") from e
    meta = {k: h[k] for k in ("conversation", "turn", "version", "state_len", "aligned_len",
                              "committed_tokens", "tokens_digest", "messages_digest")}
    meta["canonical_window"] = h.get("canonical_window", 0)  # deterministic tiles made it (0: no)
    if "prefix" in h:
        meta["prefix"] = h["prefix"]
    return VerifiedHead(meta, tuple(blocks), states)
