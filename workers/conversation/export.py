"""A committed head as content-addressed chunks, for the state tier and for migration.

    export = header + [(digest, bytes)]
    header = JSON + sha256 trailer: format, model identity, layout, conversation key (a hash),
             turn, version, state_len, aligned_len, committed tokens and their digest, the
             messages' digest, and the chunk list in order:
    chunks = kv       one per full KV block (all attention layers, K and V)
             kv_tail  the partial last block, positions past state_len zeroed
             state    one per Mamba slot role (terminal, aligned): conv + SSM of every layer

A full block never changes once written, so it is the same chunk (same name) in every
version and every conversation holding it: the tier stores it once and `MissingChunks` makes
migration incremental. The ledger (token ids, message text) is not in the export: the
importer adopts it from the cache service first and the header's digests must match it.

Threads: `snapshot_head` and `install_head` run on the engine thread and only copy tensors;
`build_export` (hashing, serialization) and `verify_export` (checksums, parsing) run anywhere.

This module makes exports; export_format.py is the wire format, export_verify.py checks a
foreign export, export_install.py installs it (all re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from proto.contract import ModelIdentity, chunk_digest, tokens_digest
from workers.cache.chunk_index import ChunkIndex
from workers.cache.holders import SlotRole
from workers.conversation.export_format import (
    FORMAT_VERSION, ChunkKind, ExportedHead, engine_layout, messages_digest, seal_header,
)
from workers.conversation.export_install import install_head
from workers.conversation.export_verify import VerifiedHead, verify_export
from workers.conversation.ledger import ConversationLedger
from workers.engine import LLMEngine
from workers.errors import ConversationNotFoundError

__all__ = [
    "FORMAT_VERSION", "ChunkKind", "ExportedHead", "HeadSnapshot", "VerifiedHead", "build_export",
    "engine_layout", "install_head", "messages_digest", "remember_chunks", "snapshot_head", "verify_export",
]

# -- engine thread: tensor copies ---------------------------------------------------------------
@dataclass(frozen=True)
class HeadSnapshot:
    identity: ModelIdentity
    layout: dict[str, Any]
    meta: dict[str, Any]  # key, turn, version, state_len, aligned_len
    token_ids: tuple[int, ...]  # committed ids and messages: only their digests leave (hashed off-thread)
    messages: tuple[dict[str, Any], ...]
    kv: torch.Tensor  # [layers, 2, blocks, block_size, heads, dim], a copy
    blocks: tuple[tuple[int, int], ...]  # (block, generation) of each position, to remember digests
    known: tuple[str | None, ...]  # digests already computed for those blocks
    roles: tuple[SlotRole, ...]
    conv: torch.Tensor  # [mamba layers, roles, ...], a copy
    ssm: torch.Tensor


def snapshot_head(engine: LLMEngine, conv: ConversationLedger) -> HeadSnapshot:
    caches = engine.caches
    head = caches.heads.find(conv.key, conv.turn)
    if head is None:
        raise ConversationNotFoundError(f"conversation {conv.ref.id!r} has no retained head to export")
    table = caches.kv.table(head.holder)
    kv = engine.runner.read_blocks(table)
    bs = caches.kv.block_size
    if head.state_len % bs:  # stale positions of the tail never leave the engine
        kv[:, :, -1, head.state_len % bs :] = 0
    slots = caches.states.slots[head.holder].roles
    conv_state, ssm_state = engine.runner.read_slots(list(slots.values()))
    meta = {
        "conversation": conv.key,
        "turn": head.turn,
        "version": head.version,
        "state_len": head.state_len,
        "aligned_len": head.aligned_len,
        "canonical_window": head.canonical_window,
    }
    return HeadSnapshot(
        identity=engine.identity,
        layout=engine_layout(engine),
        meta=meta,
        token_ids=tuple(conv.tokens_until(head.turn)),
        messages=tuple(m for t in conv.turns[: head.turn] for m in t.messages),
        kv=kv,
        blocks=tuple((b, caches.kv.generation(b)) for b in table),
        known=tuple(caches.chunks.digest_of(b) for b in table),
        roles=tuple(slots),
        conv=conv_state,
        ssm=ssm_state,
    )


# -- anywhere: hashing and serialization -----------------------------------------------------------
def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def build_export(snap: HeadSnapshot) -> ExportedHead:
    chunks: list[tuple[str, bytes]] = []
    listed: list[dict[str, Any]] = []
    full = snap.meta["state_len"] // snap.layout["block_size"]
    for i in range(snap.kv.shape[2]):
        data = _bytes(snap.kv[:, :, i])
        kind = ChunkKind.KV if i < full else ChunkKind.KV_TAIL
        digest = snap.known[i] if kind == ChunkKind.KV and snap.known[i] else chunk_digest(data)
        chunks.append((digest, data))
        listed.append({"kind": kind, "digest": digest, "size": len(data)})
    for j, role in enumerate(snap.roles):
        data = _bytes(snap.conv[:, j]) + _bytes(snap.ssm[:, j])
        digest = chunk_digest(data)
        chunks.append((digest, data))
        listed.append({"kind": ChunkKind.STATE, "role": role.value, "digest": digest, "size": len(data)})
    prefix = snap.meta.get("prefix")
    header = {
        "format": FORMAT_VERSION,
        "identity": snap.identity.to_dict(),
        "layout": snap.layout,
        **snap.meta,
        # A prefix checkpoint is named by its tokens' digest already (prefix_export.py): no ids to hash.
        "committed_tokens": prefix["length"] if prefix else len(snap.token_ids),
        "tokens_digest": prefix["digest"] if prefix else tokens_digest(snap.token_ids),
        "messages_digest": messages_digest(list(snap.messages)),
        "chunks": listed,
    }
    return ExportedHead(seal_header(header), tuple(chunks))


def remember_chunks(chunks: ChunkIndex, snap: HeadSnapshot, exported: ExportedHead) -> None:
    """Keep the digests an export computed, so the next one (and MissingChunks) need no hashing."""
    full = snap.meta["state_len"] // snap.layout["block_size"]
    for (block, generation), (digest, _) in list(zip(snap.blocks, exported.chunks))[:full]:
        chunks.remember(block, generation, digest)
