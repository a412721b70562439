"""The one place where the worker deployment calls the engine and its conversation cache
(`workers/conversation/API.md`). Engine state is touched only on the engine thread
(`AsyncEngine.call`/`stream`); hashing and (de)serialization of exports run off it.

A turn's commit is two-phase across replicas:

    stream_turn (CommitMode.PREPARE) ... final output carries the TurnCommit
        publish to the cache service (CAS on the head version, fenced by the lease)
        ok       -> commit(record)    the prepared state becomes the head
        refused  -> abandon(record)   the previous head is untouched

Local state is reused only if it is exactly the service's head (version, turn, token digest);
otherwise the worker rebuilds it (tier import or ledger recompute), never trusting a copy that
may lag or lead the service.

A tier entry is one blob cut into parts, so that unchanged KV blocks are the same chunks from
one version to the next (the tier stores and sends each once):

    part 0: u32 length | JSON index {"header": n, "chunks": [[digest, size], ...]}
    part 1: the export header (self-checking)      parts 2..: the export's chunks, in order
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

from deployments.protocol import HeadRef
from deployments.settings import AppSettings
from workers.async_engine import AsyncEngine
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.conversation import export as head_export
from workers.conversation.cache import ConversationCache
from workers.conversation.ledger import conversation_key, tokens_digest
from workers.conversation.records import CommitMode, HeadInfo, LedgerTurn, TurnCommit
from workers.engine import LLMEngine, RequestOutput
from workers.errors import CorruptStateError
from workers.request import Request
from workers.sampling import SamplingParams

_INDEX_LEN = struct.Struct("<I")


def pack_export(exported: head_export.ExportedHead) -> list[bytes]:
    index = json.dumps({"header": len(exported.header), "chunks": [[d, len(c)] for d, c in exported.chunks]},
                       separators=(",", ":")).encode()
    return [_INDEX_LEN.pack(len(index)) + index, exported.header, *(c for _, c in exported.chunks)]


def unpack_export(blob: bytes) -> tuple[bytes, dict[str, bytes]]:
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


class EngineSession:
    def __init__(self, model_dir: str, settings: AppSettings):
        config = EngineConfig(
            model=model_dir,
            device=settings.device,
            num_threads=settings.torch_threads,
            max_model_len=settings.max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=settings.max_num_seqs),
            cache=CacheConfig(kv_cache_bytes=settings.kv_cache_mb << 20, head_cache_bytes=settings.head_cache_mb << 20),
            weight_quantization=settings.weight_quantization,
        )
        engine = LLMEngine(config)
        self.cache = ConversationCache(engine, retain_turns=1)
        self.identity, self.layout = self.cache.export_identity()
        self.aengine = AsyncEngine(engine)

    def shutdown(self) -> None:
        self.aengine.shutdown()

    # -- what this engine holds -------------------------------------------------------------
    async def holds(self, conversation_id: str, cache_salt: str, head: HeadRef) -> bool:
        """Whether this engine holds exactly `head`: its ledger at that version and its state."""
        key = conversation_key(conversation_id, cache_salt)

        def local(_e) -> list[int] | None:
            conv = self.cache.conversations.get(key)
            if conv is None or conv.in_flight is not None or (conv.version, conv.turn) != (head.version, head.turn):
                return None
            return list(conv.token_ids) if self.cache.heads.find(key, conv.turn) is not None else None

        tokens = await self.aengine.call(local)
        return tokens is not None and _is_head(tokens, head)

    async def forget(self, conversation_id: str, cache_salt: str, deleted: HeadRef | None = None) -> None:
        """Drop the conversation's local ledger and heads; with `deleted` only if the ledger is
        exactly that head (compared off the engine thread, like `holds`), not a re-created
        conversation's. An older local copy of the deleted one stays until eviction, and serves
        only if a re-created conversation's ledger has its very tokens (adopt_ledger drops it
        otherwise), when its state is exact anyway."""
        key = conversation_key(conversation_id, cache_salt)

        def ledger(_e) -> tuple[int, int, list[int]] | None:
            conv = self.cache.conversations.get(key)
            return None if conv is None else (conv.version, conv.turn, list(conv.token_ids))

        seen = None
        if deleted is not None:
            seen = await self.aengine.call(ledger)
            if seen is None or seen[:2] != (deleted.version, deleted.turn) or not _is_head(seen[2], deleted):
                return

        def drop(_e) -> None:
            if key in self.cache.conversations and (seen is None or ledger(_e) == seen):  # unchanged meanwhile
                self.cache.delete(conversation_id, cache_salt)

        await self.aengine.call(drop)

    async def held_heads(self, conversation_id: str | None = None, cache_salt: str = "") -> int:
        if conversation_id is None:
            return await self.aengine.call(lambda _e: len(self.cache.heads))
        key = conversation_key(conversation_id, cache_salt)
        return await self.aengine.call(lambda _e: len(self.cache.heads.of_conversation(key)))

    async def adopt_ledger(self, conversation_id: str, cache_salt: str, head: HeadRef,
                           turns: list[LedgerTurn]) -> None:
        """Take the service's ledger at `head` as this engine's (the next turn recomputes from it)."""
        tokens = [t for turn in turns for t in turn.token_ids]
        if len(turns) != head.turn or not _is_head(tokens, head):
            raise CorruptStateError("the ledger does not add up to the conversation's head")
        await self.aengine.call(
            lambda _e: self.cache.adopt_ledger(conversation_id, cache_salt, version=head.version, turns=turns))

    async def import_state(self, conversation_id: str, cache_salt: str, blob: bytes) -> HeadInfo:
        """Install a head exported by another replica; the ledger must be adopted first."""
        held = await self.aengine.call(lambda _e: self.cache.held_chunk_digests())

        def verify() -> head_export.VerifiedHead:
            header, chunks = unpack_export(blob)
            return head_export.verify_export(header, chunks, self.identity, self.layout, held)

        verified = await asyncio.to_thread(verify)
        return await self.aengine.call(lambda _e: self.cache.install_head(conversation_id, cache_salt, verified))

    async def export_state(self, conversation_id: str, cache_salt: str) -> tuple[int, list[bytes]]:
        """(head version, tier parts) of the conversation's latest head."""
        snapshot = await self.aengine.call(lambda _e: self.cache.snapshot_head(conversation_id, cache_salt))
        exported = await asyncio.to_thread(head_export.build_export, snapshot)
        await self.aengine.call(lambda _e: self.cache.remember_chunks(snapshot, exported))
        return snapshot.meta["version"], pack_export(exported)

    async def load(self) -> tuple[int, int]:
        """(requests in the engine, free KV blocks), for routing stats and heartbeats."""

        def read(e: LLMEngine) -> tuple[int, int]:
            return len(e.scheduler.requests), e.caches.kv.pool.num_free

        return await self.aengine.call(read)

    # -- turns ------------------------------------------------------------------------------
    def stream_turn(
        self,
        conversation_id: str,
        cache_salt: str,
        suffix: list[dict[str, Any]],
        params: SamplingParams,
        request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """The final output's `turn_commit` is the prepared turn (None if it was discarded)."""
        start = lambda _e: self.cache.begin_turn(  # noqa: E731
            conversation_id, cache_salt, suffix, params, request_id, commit=CommitMode.PREPARE)
        return self.aengine.stream(request_id, start)

    def stream_stateless(
        self, messages: list[dict[str, Any]], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        def start(e: LLMEngine) -> Request:  # the stream follows the request start returns
            prompt = e.tokenizer.encode(e.tokenizer.render_chat(messages, add_generation_prompt=True))
            return e.add_request(request_id, prompt, params)

        return self.aengine.stream(request_id, start)

    async def commit(self, record: TurnCommit) -> HeadInfo:
        return await self.aengine.call(lambda _e: self.cache.commit(record))

    async def abandon(self, record: TurnCommit) -> None:
        await self.aengine.call(lambda _e: self.cache.abandon(record))

    def token_text(self, token_id: int) -> str:
        return self.cache.engine.tokenizer.decode_exact([token_id])


def _is_head(tokens: list[int], head: HeadRef) -> bool:
    return len(tokens) == head.committed_tokens and tokens_digest(tokens) == head.tokens_sha256
