"""A vLLM backend head as a state tier entry, in the tier's framing (export_format.pack_export):

    header = sealed JSON {"format": "vllm/1", identity, layout, conversation, turn, version,
                          committed_tokens, tokens_digest, state_len, chunks: [{digest, size, kind}]}
    chunks: one per KV block index (every attention layer's block, in layer order), then the
            Mamba state pages of every layer in one chunk

A prefix checkpoint (prefixes.py) travels in the same format, owned by no conversation: its
header has "prefix": {scope: sha256 of the salt, length, digest}, conversation "", turn 0, and
committed_tokens = state_len = length (its state covers all its tokens; a head's, all but the
last), as our engine's prefix exports (workers/conversation/prefix_export.py).

The layout is the engine host's: vLLM's version, its block size, the conv-state layout of its
Mamba kernels (SD or DS, a platform choice), every layer's name, shape and dtype. A head is only
installed where format, model identity and layout are all equal: never across backends (our
engine's exports are format 2), vLLM versions or kernel layouts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from proto.contract import ModelIdentity, chunk_digest
from workers.conversation.export_format import ExportedHead, parse_fitting_header, seal_header
from workers.conversation.prefix_export import scope_digest
from workers.errors import CorruptStateError
from workers.identity import model_identity
from workers.quantization import WeightQuantization

FORMAT = "vllm/1"


async def host_identity(model_dir: str, device: str, info: dict[str, Any]) -> ModelIdentity:
    """The model identity a head exported by this host carries: vLLM's kernels make the bits,
    so its torch and dtype, not ours (the weights' digest reads every file: off the event loop)."""
    base = await asyncio.to_thread(model_identity, model_dir, torch.float32, device, WeightQuantization.NONE)
    return ModelIdentity(base.weights_digest, base.config_digest, info["dtype"], info["torch"], base.device_kind)


def host_layout(info: dict[str, Any]) -> dict[str, Any]:
    """What of the host's info decides whether a head's bytes fit it."""
    return {"backend": "vllm", **{k: info[k] for k in ("vllm", "block_size", "conv_state_layout", "attention", "mamba")}}


@dataclass(frozen=True)
class HeadParts:
    """A head as the engine host exports and installs it."""

    state_len: int
    blocks: list[bytes]
    state: bytes


def build_export(meta: dict[str, Any], identity: ModelIdentity, layout: dict[str, Any], parts: HeadParts) -> ExportedHead:
    chunks = [(chunk_digest(b), b) for b in parts.blocks] + [(chunk_digest(parts.state), parts.state)]
    kinds = ["kv"] * len(parts.blocks) + ["state"]
    header = {
        "format": FORMAT, "identity": identity.to_dict(), "layout": layout, **meta, "state_len": parts.state_len,
        "chunks": [{"digest": d, "size": len(c), "kind": k} for (d, c), k in zip(chunks, kinds, strict=True)],
    }
    return ExportedHead(seal_header(header), tuple(chunks))


def prefix_meta(scope: str, length: int, digest: str) -> dict[str, Any]:
    """The header fields of a prefix checkpoint's export: `scope`, the salt (only its digest goes)."""
    return {"conversation": "", "turn": 0, "version": 0, "committed_tokens": length, "tokens_digest": digest,
            "prefix": {"scope": scope_digest(scope), "length": length, "digest": digest}}


def verify_export(header: bytes, chunks: dict[str, bytes], identity: ModelIdentity,
                  layout: dict[str, Any]) -> tuple[dict[str, Any], HeadParts]:
    """(the header's meta, the head's parts) if the export is intact and fits this engine host;
    CorruptStateError otherwise."""
    h = parse_fitting_header(header, identity, layout, FORMAT)
    try:
        listed, state_len = h["chunks"], int(h["state_len"])
        expected = -(-state_len // layout["block_size"])
        prefix = h.get("prefix")
        # a head's state covers all its tokens but the last; a prefix checkpoint's, all of them
        committed = state_len if prefix is not None else state_len + 1
        if [c["kind"] for c in listed] != ["kv"] * expected + ["state"] or h["committed_tokens"] != committed:
            raise CorruptStateError("inconsistent export: chunks do not cover state_len")
        if prefix is not None and (prefix["length"] != state_len or prefix["digest"] != h["tokens_digest"]):
            raise CorruptStateError("inconsistent export: the prefix does not name its state")
        data = []
        for c in listed:
            raw = chunks.get(c["digest"])
            if raw is None or len(raw) != c["size"] or chunk_digest(raw) != c["digest"]:
                raise CorruptStateError(f"chunk {str(c['digest'])[:16]} is missing or failed its checksum")
            data.append(raw)
        meta = {k: h[k] for k in ("conversation", "turn", "version", "committed_tokens", "tokens_digest")}
        if prefix is not None:
            meta["prefix"] = {k: prefix[k] for k in ("scope", "length", "digest")}
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptStateError(f"malformed export header: {e!r}") from e
    return meta, HeadParts(state_len, data[:-1], data[-1])
