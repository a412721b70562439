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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from proto.contract import ModelIdentity, chunk_digest, conversation_key, tokens_digest
from workers.cache import state_io
from workers.cache.holders import HolderSlots, SlotRole
from workers.conversation.records import HeadInfo
from workers.errors import ConversationBusyError, ConversationNotFoundError, CorruptStateError

if TYPE_CHECKING:
    from workers.conversation.cache import ConversationCache
    from workers.engine import LLMEngine

FORMAT_VERSION = 2
_TRAILER = 32


class ChunkKind:
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


def snapshot_head(cc: ConversationCache, conversation_id: str, cache_salt: str) -> HeadSnapshot:
    conv = cc.conversation_of(conversation_id, cache_salt)
    head = cc.heads.find(conv.key, conv.turn)
    if head is None:
        raise ConversationNotFoundError(f"conversation {conversation_id!r} has no retained head to export")
    caches, pool = cc.engine.runner.caches, cc.kv.pool
    table = cc.kv.table(head.holder)
    kv = state_io.read_blocks(caches, table)
    bs = cc.kv.block_size
    if head.state_len % bs:  # stale positions of the tail never leave the engine
        kv[:, :, -1, head.state_len % bs :] = 0
    slots = cc.states.slots[head.holder].roles
    conv_state, ssm_state = state_io.read_slots(caches, list(slots.values()))
    meta = {
        "conversation": conv.key,
        "turn": head.turn,
        "version": head.version,
        "state_len": head.state_len,
        "aligned_len": head.aligned_len,
        "canonical_window": head.canonical_window,
    }
    return HeadSnapshot(
        identity=cc.engine.identity,
        layout=engine_layout(cc.engine),
        meta=meta,
        token_ids=tuple(conv.tokens_until(head.turn)),
        messages=tuple(m for t in conv.turns[: head.turn] for m in t.messages),
        kv=kv,
        blocks=tuple((b, pool.generation[b]) for b in table),
        known=tuple(cc.caches.chunks.digest_of(b) for b in table),
        roles=tuple(slots),
        conv=conv_state,
        ssm=ssm_state,
    )


# -- anywhere: hashing and serialization -----------------------------------------------------------
@dataclass(frozen=True)
class ExportedHead:
    header: bytes
    chunks: tuple[tuple[str, bytes], ...]  # (digest, bytes) in header order

    @property
    def digests(self) -> list[str]:
        return [d for d, _ in self.chunks]


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
    header = {
        "format": FORMAT_VERSION,
        "identity": snap.identity.to_dict(),
        "layout": snap.layout,
        **snap.meta,
        "committed_tokens": len(snap.token_ids),
        "tokens_digest": tokens_digest(snap.token_ids),
        "messages_digest": messages_digest(list(snap.messages)),
        "chunks": listed,
    }
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return ExportedHead(raw + hashlib.sha256(raw).digest(), tuple(chunks))


@dataclass(frozen=True)
class VerifiedHead:
    meta: dict[str, Any]
    blocks: tuple[tuple[str, torch.Tensor | None], ...]  # (digest, data or None: held by the importer)
    states: dict[SlotRole, tuple[torch.Tensor, torch.Tensor]]  # role -> (conv, ssm) of every layer


def _parse_header(header: bytes) -> dict[str, Any]:
    raw, trailer = header[:-_TRAILER], header[-_TRAILER:]
    if len(header) <= _TRAILER or hashlib.sha256(raw).digest() != trailer:
        raise CorruptStateError("the export header failed its checksum")
    try:
        parsed = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptStateError(f"unreadable export header: {e}") from e
    if not isinstance(parsed, dict) or parsed.get("format") != FORMAT_VERSION:
        raise CorruptStateError(f"unknown export format {parsed.get('format') if isinstance(parsed, dict) else None!r}")
    return parsed


def _shapes(layout: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype, tuple[int, ...], tuple[int, ...]]:
    layers, heads, dim = layout["kv"]
    m_layers, conv_dim, width, n_heads, head_dim, d_state = layout["mamba"]
    kv_dtype = getattr(torch, layout["kv_dtype"].removeprefix("torch."))
    return (layers, 2, layout["block_size"], heads, dim), kv_dtype, (m_layers, conv_dim, width), (
        m_layers, n_heads, head_dim, d_state)


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
            (h["committed_tokens"] != state_len + 1, "state_len must be the committed length - 1"),
            (not 0 <= aligned <= state_len, "aligned_len out of range"),
            # Every head holds both states: a turn continuing it copies the aligned one as well.
            (roles != [SlotRole.TERMINAL.value, SlotRole.ALIGNED.value], "slot roles"),
            (h["turn"] < 1, "turn must be >= 1"),
        ]
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptStateError(f"malformed export header: {e!r}") from e
    bad = [why for failed, why in problems if failed]
    if bad:
        raise CorruptStateError("inconsistent export: " + "; ".join(bad))


def verify_export(
    header: bytes,
    chunks: Mapping[str, bytes],
    identity: ModelIdentity,
    layout: dict[str, Any],
    held: set[str] = frozenset(),
) -> VerifiedHead:
    """Check an export against this engine and parse it; `chunks` may leave out `held` ones."""
    h = _parse_header(header)
    try:
        foreign = ModelIdentity.from_dict(h["identity"])
    except (KeyError, TypeError) as e:
        raise CorruptStateError(f"malformed model identity: {e!r}") from e
    if foreign != identity:
        raise CorruptStateError(f"the export was made by another model or machine kind: {foreign} vs {identity}")
    if h.get("layout") != layout:
        raise CorruptStateError(f"cache layout differs: {h.get('layout')} vs {layout}")
    _check_consistent(h)
    kv_shape, kv_dtype, conv_shape, ssm_shape = _shapes(layout)
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
    return VerifiedHead(meta, tuple(blocks), states)


# -- engine thread: install, remember ---------------------------------------------------------------
def install_head(cc: ConversationCache, conversation_id: str, cache_salt: str, verified: VerifiedHead) -> HeadInfo:
    """Install a verified head for a conversation whose ledger this engine holds (adopted).

    All-or-nothing: CorruptStateError (it does not match the ledger, a held chunk is gone) or
    OutOfCacheError leave the engine exactly as it was."""
    meta = verified.meta
    key = conversation_key(conversation_id, cache_salt)
    if meta["conversation"] != key:
        raise CorruptStateError("the export belongs to another conversation or cache_salt")
    conv = cc.conversations.get(key)
    if conv is None:
        raise ConversationNotFoundError(f"no ledger of {conversation_id!r} here: adopt it from the service first")
    if conv.in_flight is not None:
        raise ConversationBusyError(f"conversation {conversation_id!r} has a turn in flight")
    turn = meta["turn"]
    committed = conv.tokens_until(turn) if turn <= conv.turn else None
    messages = [m for t in conv.turns[:turn] for m in t.messages]
    # The digests prove which tokens and messages; the length is checked too, since state_len
    # is trusted from it.
    if (
        committed is None
        or meta["committed_tokens"] != len(committed)
        or tokens_digest(committed) != meta["tokens_digest"]
        or messages_digest(messages) != meta["messages_digest"]
    ):
        raise CorruptStateError("the export does not match this engine's ledger of the conversation")
    existing = cc.heads.find(key, turn)
    if existing is not None:
        return cc.head_info(conv, existing)
    shared: list[int | None] = []
    for digest, data in verified.blocks:
        block = cc.caches.chunks.block_of(digest) if data is None else None
        if data is None and block is None:
            raise CorruptStateError(f"chunk {digest[:16]} is no longer held here: send it")
        shared.append(block)
    caches = cc.engine.runner.caches

    def write(new_blocks: list[int], slots: HolderSlots) -> None:
        fresh = [data for _, data in verified.blocks if data is not None]
        if fresh:
            state_io.write_blocks(caches, new_blocks, torch.stack(fresh, dim=2))
        roles = slots.roles
        conv_t = torch.stack([verified.states[r][0] for r in roles], dim=1)
        ssm_t = torch.stack([verified.states[r][1] for r in roles], dim=1)
        state_io.write_slots(caches, list(roles.values()), conv_t, ssm_t)

    head = cc.caches.install_head(
        key, turn, meta["version"], meta["state_len"], meta["aligned_len"], shared,
        aligned=SlotRole.ALIGNED in verified.states, write=write, canonical_window=meta["canonical_window"],
    )
    pool = cc.kv.pool
    full = meta["state_len"] // cc.kv.block_size
    for (digest, _), block in list(zip(verified.blocks, cc.kv.table(head.holder)))[:full]:
        cc.caches.chunks.remember(block, pool.generation[block], digest)
    cc.retire_older_heads(key, turn)
    return cc.head_info(conv, head)


def remember_chunks(cc: ConversationCache, snap: HeadSnapshot, exported: ExportedHead) -> None:
    """Keep the digests an export computed, so the next one (and MissingChunks) need no hashing."""
    full = snap.meta["state_len"] // snap.layout["block_size"]
    for (block, generation), (digest, _) in list(zip(snap.blocks, exported.chunks))[:full]:
        cc.caches.chunks.remember(block, generation, digest)
