"""Export and import of a committed head as a self-describing, checksummed byte stream.

    stream  = MAGIC | u32 header length | header (JSON) | block payloads | state payload | sha256
    header  = model identity, cache layout, the conversation's ledger, the head (turn, lengths),
              and per KV block of the head its sha256 and whether its bytes are included

Full KV blocks never change once written, so an export can leave out the blocks the receiver
already holds (`have` = digests it reported, see `known_block_digests`); the receiver shares its
own copies by reference. The tail block and the Mamba states are always included.
Any mismatch (checksum, model, layout, a block the receiver does not have) raises
`CorruptStateError` and changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from workers.cache.holders import Holder
from workers.conversation.cache import ConversationCache
from workers.conversation.heads import CommittedHead
from workers.conversation.ledger import Conversation, Turn, conversation_key
from workers.errors import ConversationBusyError, ConversationNotFoundError, CorruptStateError

MAGIC = b"HSHEAD01"
FORMAT_VERSION = 1
_DIGEST = 32


def model_identity(model_dir: Path, dtype: torch.dtype) -> str:
    """sha256 over config.json and the weights: a head only fits the exact same model."""
    h = hashlib.sha256(str(dtype).encode())
    for f in [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


class HeadTransfer:
    """Exports and imports heads of one engine's conversation cache."""

    def __init__(self, cache: ConversationCache):
        self.cache = cache
        engine = cache.engine
        self.caches = engine.runner.caches
        self.identity = model_identity(Path(engine.config.model), engine.config.dtype)
        self.layout = {
            "block_size": engine.kv_layout.block_size,
            "kv": [engine.kv_layout.num_layers, engine.kv_layout.n_kv_heads, engine.kv_layout.head_dim],
            "kv_dtype": str(engine.kv_layout.dtype),
            "mamba": [
                engine.state_layout.num_layers,
                engine.state_layout.conv_dim,
                engine.state_layout.conv_width,
                engine.state_layout.n_heads,
                engine.state_layout.head_dim,
                engine.state_layout.d_state,
            ],
            "state_dtype": str(engine.state_layout.dtype),
        }

    # -- bytes of cache entries -----------------------------------------------------------------
    def _block_bytes(self, block: int) -> bytes:
        return b"".join(kv[:, block].contiguous().numpy().tobytes() for kv in self.caches.kv)

    def _write_block(self, block: int, data: bytes) -> None:
        per_layer = len(data) // len(self.caches.kv)
        for i, kv in enumerate(self.caches.kv):
            piece = torch.frombuffer(bytearray(data[i * per_layer : (i + 1) * per_layer]), dtype=kv.dtype)
            kv[:, block] = piece.view(kv[:, block].shape)

    def _state_bytes(self, slots: list[int]) -> bytes:
        parts = []
        for slot in slots:
            for conv, ssm in zip(self.caches.conv, self.caches.ssm):
                parts += [conv[slot].contiguous().numpy().tobytes(), ssm[slot].contiguous().numpy().tobytes()]
        return b"".join(parts)

    def _write_states(self, slots: list[int], data: bytes) -> None:
        offset = 0
        for slot in slots:
            for conv, ssm in zip(self.caches.conv, self.caches.ssm):
                for tensor in (conv, ssm):
                    n = tensor[slot].numel() * tensor.element_size()
                    piece = torch.frombuffer(bytearray(data[offset : offset + n]), dtype=tensor.dtype)
                    tensor[slot] = piece.view(tensor[slot].shape)
                    offset += n

    def known_block_digests(self) -> dict[str, int]:
        """digest -> local block, over the full blocks held by committed heads."""
        known = {}
        bs = self.cache.kv.block_size
        for head in self.cache.heads.all():
            table = self.cache.kv.table(head.holder)
            for block in table[: head.state_len // bs]:
                known.setdefault(hashlib.sha256(self._block_bytes(block)).hexdigest(), block)
        return known

    # -- export ----------------------------------------------------------------------------------
    def export_head(self, conversation_id: str, cache_salt: str, have: set[str] = frozenset()) -> bytes:
        conv = self.cache._conversation(conversation_id, cache_salt)
        head = self.cache.heads.get(conv.key, conv.turn)
        if head is None:
            raise ConversationNotFoundError(f"conversation {conversation_id!r} has no retained head to export")
        bs = self.cache.kv.block_size
        table = self.cache.kv.table(head.holder)
        full = head.state_len // bs
        blocks, payload = [], []
        for i, block in enumerate(table):
            data = self._block_bytes(block)
            digest = hashlib.sha256(data).hexdigest()
            include = i >= full or digest not in have
            blocks.append({"digest": digest, "included": include})
            if include:
                payload.append(data)
        states = self._state_bytes(self.cache.states.slots[head.holder])
        header = {
            "format": FORMAT_VERSION,
            "model": self.identity,
            "layout": self.layout,
            "conversation": {
                "conversation_id": conv.conversation_id,
                "key": conv.key,
                "token_ids": conv.token_ids,
                "turns": [{"number": t.number, "messages": t.messages, "start": t.start, "end": t.end} for t in conv.turns],
            },
            "head": {"turn": head.turn, "state_len": head.state_len, "aligned_len": head.aligned_len},
            "blocks": blocks,
            "states": {"slots": len(self.cache.states.slots[head.holder]), "sha256": hashlib.sha256(states).hexdigest()},
        }
        raw_header = json.dumps(header, separators=(",", ":")).encode()
        body = MAGIC + struct.pack("<I", len(raw_header)) + raw_header + b"".join(payload) + states
        return body + hashlib.sha256(body).digest()

    # -- import ----------------------------------------------------------------------------------
    def import_head(self, stream: bytes, cache_salt: str) -> str:
        header, blocks_data, states = self._parse(stream)
        conv_info, head_info = header["conversation"], header["head"]
        key = conversation_key(conv_info["conversation_id"], cache_salt)
        if key != conv_info["key"]:
            raise CorruptStateError("the stream belongs to another cache_salt")
        existing = self.cache.conversations.get(key)
        if existing is not None and existing.in_flight is not None:
            raise ConversationBusyError(f"conversation {conv_info['conversation_id']!r} has a turn in flight")
        known = self.known_block_digests()
        missing = [b["digest"] for b in header["blocks"] if not b["included"] and b["digest"] not in known]
        if missing:
            raise CorruptStateError(f"stream leaves out {len(missing)} blocks this engine does not hold")

        holder = Holder.head(f"{key}#{head_info['turn']}#import{next(self.cache._head_ids)}")
        included = iter(blocks_data)
        for b in header["blocks"]:
            if b["included"]:
                (block,) = self.cache.kv.append_new(holder, 1)
                self._write_block(block, next(included))
            else:
                self.cache.kv.share(holder, [known[b["digest"]]])
        slots = [self.cache.states.allocate(holder) for _ in range(header["states"]["slots"])]
        self._write_states(slots, states)
        if existing is not None:  # only now: its blocks may be the ones just shared
            self.cache.delete(conv_info["conversation_id"], cache_salt)
        conv = Conversation(key, conv_info["conversation_id"], list(conv_info["token_ids"]))
        conv.turns = [Turn(t["number"], t["messages"], t["start"], t["end"]) for t in conv_info["turns"]]
        self.cache.conversations[key] = conv
        self.cache.heads.add(
            CommittedHead(holder, key, head_info["turn"], head_info["state_len"], head_info["aligned_len"])
        )
        return conv.conversation_id

    def _check_consistent(self, header: dict) -> None:
        """Checksums prove the bytes are what the exporter wrote, not that it wrote sense."""
        try:
            conv, head, bs = header["conversation"], header["head"], self.layout["block_size"]
            tokens, turns = conv["token_ids"], conv["turns"]
            problems = [
                (head["state_len"] != len(tokens) - 1, "state_len must be the committed length - 1"),
                (head["turn"] != len(turns) or not turns, "head turn must be the last turn"),
                (bool(turns) and turns[-1]["end"] != len(tokens), "the last turn must end the token ids"),
                (len(header["blocks"]) != -(-head["state_len"] // bs), "block count does not cover state_len"),
                (not 0 <= head["aligned_len"] <= head["state_len"], "aligned_len out of range"),
                (header["states"]["slots"] not in (1, 2), "a head has one or two state slots"),
            ]
        except (KeyError, TypeError) as e:
            raise CorruptStateError(f"malformed header: {e!r}") from e
        bad = [why for failed, why in problems if failed]
        if bad:
            raise CorruptStateError("inconsistent head: " + "; ".join(bad))

    def _parse(self, stream: bytes) -> tuple[dict, list[bytes], bytes]:
        if len(stream) < len(MAGIC) + 4 + _DIGEST or not stream.startswith(MAGIC):
            raise CorruptStateError("not a hybridserve head stream")
        body, trailer = stream[:-_DIGEST], stream[-_DIGEST:]
        if hashlib.sha256(body).digest() != trailer:
            raise CorruptStateError("stream checksum mismatch")
        (length,) = struct.unpack_from("<I", body, len(MAGIC))
        offset = len(MAGIC) + 4
        try:
            header = json.loads(body[offset : offset + length])
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptStateError(f"unreadable header: {e}") from e
        offset += length
        if header.get("format") != FORMAT_VERSION:
            raise CorruptStateError(f"unknown stream format {header.get('format')!r}")
        if header["model"] != self.identity:
            raise CorruptStateError("the stream was exported by another model")
        if header["layout"] != self.layout:
            raise CorruptStateError(f"cache layout differs: {header['layout']} vs {self.layout}")
        self._check_consistent(header)
        block_size = len(self._block_bytes(0))
        blocks_data = []
        for b in header["blocks"]:
            if b["included"]:
                data = body[offset : offset + block_size]
                if hashlib.sha256(data).hexdigest() != b["digest"]:
                    raise CorruptStateError("a KV block failed its checksum")
                blocks_data.append(data)
                offset += block_size
        states = body[offset:]
        if hashlib.sha256(states).hexdigest() != header["states"]["sha256"]:
            raise CorruptStateError("the Mamba state failed its checksum")
        return header, blocks_data, states
