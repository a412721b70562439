"""The one place where the worker deployment calls the engine and its conversation cache.

Everything runs on the engine thread through `AsyncEngine.call`/`stream`. A turn's commit is
two-phase across replicas:

    stream_turn ... finished ──> prepared(conv)      the turn's state is held locally
                                 publish to the cache service (CAS on the head version, fenced)
                                 ok       ──> commit(prepared)    the prepared state is the head
                                 conflict ──> abandon(prepared)   back to the previous head

Here the engine's conversation cache makes the finished turn its head as soon as the request
finishes, and keeps the previous turn's head too (`retain_turns=2`), so abandoning is a rewind
to the base turn. Whatever happens, a worker only reuses local state after checking it against
the service's head (turn, token count, token digest): local state can lag or lead the service,
it is never trusted blindly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deployments.protocol import HeadRef
from deployments.settings import AppSettings
from workers.async_engine import AsyncEngine
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.conversation.cache import ConversationCache
from workers.conversation.ledger import Conversation, Turn, conversation_key, tokens_digest
from workers.conversation.transfer import HeadTransfer
from workers.engine import LLMEngine, RequestOutput
from workers.errors import CorruptStateError
from workers.sampling import SamplingParams


@dataclass(frozen=True)
class PreparedTurn:
    """A finished turn held by this engine, not yet confirmed by the cache service."""

    conversation_id: str
    cache_salt: str
    base_turn: int
    turn: int
    messages: list[dict[str, Any]]  # the suffix and the assistant reply
    turn_token_ids: list[int]  # this turn's new tokens (prompt suffix + generated)
    committed_tokens: int
    tokens_sha256: str


@dataclass(frozen=True)
class LedgerTurn:
    messages: list[dict[str, Any]]
    token_ids: list[int]


class EngineSession:
    def __init__(self, model_dir: str, settings: AppSettings):
        config = EngineConfig(
            model=model_dir,
            num_threads=settings.torch_threads,
            max_model_len=settings.max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=settings.max_num_seqs),
            cache=CacheConfig(kv_cache_bytes=settings.kv_cache_mb << 20, head_cache_bytes=settings.head_cache_mb << 20),
        )
        engine = LLMEngine(config)
        self.max_model_len = engine.max_model_len
        self.cache = ConversationCache(engine, retain_turns=2)
        self.transfer = HeadTransfer(self.cache)
        self.aengine = AsyncEngine(engine)

    def shutdown(self) -> None:
        self.aengine.shutdown()

    # -- what this engine holds -------------------------------------------------------------
    async def holds(self, conversation_id: str, cache_salt: str, head: HeadRef) -> bool:
        """Whether this engine holds exactly `head`'s state (ledger and retained head)."""
        key = conversation_key(conversation_id, cache_salt)

        def local(_e) -> list[int] | None:
            conv = self.cache.conversations.get(key)
            if conv is None or conv.in_flight is not None or conv.turn != head.turn:
                return None
            return list(conv.token_ids) if self.cache.heads.get(key, conv.turn) is not None else None

        tokens = await self.aengine.call(local)
        return tokens is not None and _matches(tokens, head)

    async def forget(self, conversation_id: str, cache_salt: str) -> None:
        key = conversation_key(conversation_id, cache_salt)

        def drop(_e) -> None:
            if key in self.cache.conversations:
                self.cache.delete(conversation_id, cache_salt)

        await self.aengine.call(drop)

    async def import_state(self, conversation_id: str, cache_salt: str, data: bytes, head: HeadRef) -> None:
        """Adopt an exported head; CorruptStateError (and nothing kept) unless it is `head`."""
        await self.aengine.call(lambda _e: self.transfer.import_head(data, cache_salt))
        if not await self.holds(conversation_id, cache_salt, head):
            await self.forget(conversation_id, cache_salt)
            raise CorruptStateError("the tier's state is not the conversation's current head")

    async def adopt_ledger(self, conversation_id: str, cache_salt: str, turns: list[LedgerTurn], head: HeadRef) -> None:
        """Take the service's ledger as this engine's: the next turn recomputes from its token ids."""
        key = conversation_key(conversation_id, cache_salt)
        conv = Conversation(key, conversation_id)
        for number, turn in enumerate(turns, start=1):
            start = len(conv.token_ids)
            conv.token_ids.extend(turn.token_ids)
            conv.turns.append(Turn(number, list(turn.messages), start, len(conv.token_ids)))
        if not _matches(conv.token_ids, head) or conv.turn != head.turn:
            raise CorruptStateError("the ledger does not add up to the conversation's head")

        def adopt(_e) -> None:
            if key in self.cache.conversations:
                self.cache.delete(conversation_id, cache_salt)
            self.cache.conversations[key] = conv

        await self.aengine.call(adopt)

    async def export_state(self, conversation_id: str, cache_salt: str) -> bytes:
        return await self.aengine.call(lambda _e: self.transfer.export_head(conversation_id, cache_salt))

    async def load(self) -> tuple[int, int]:
        """(running + waiting requests, free KV blocks), for routing stats and heartbeats."""

        def read(e: LLMEngine) -> tuple[int, int]:
            return len(e.scheduler.requests), e.caches.kv.pool.num_free

        return await self.aengine.call(read)

    # -- turns ------------------------------------------------------------------------------
    def stream_turn(
        self, conversation_id: str, cache_salt: str, suffix: list[dict[str, Any]], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        start = lambda _e: self.cache.begin_turn(conversation_id, cache_salt, suffix, params, request_id)  # noqa: E731
        return self.aengine.stream(request_id, start)

    def stream_stateless(
        self, messages: list[dict[str, Any]], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        def start(e: LLMEngine) -> None:
            prompt = e.tokenizer.encode(e.tokenizer.render_chat(messages, add_generation_prompt=True))
            e.add_request(request_id, prompt, params)

        return self.aengine.stream(request_id, start)

    async def prepared(self, conversation_id: str, cache_salt: str, base_turn: int) -> PreparedTurn:
        def read(_e) -> tuple[int, list[dict[str, Any]], list[int], int]:
            conv = self.cache._conversation(conversation_id, cache_salt)
            last = conv.turns[-1]
            return conv.turn, list(last.messages), list(conv.token_ids), last.start

        turn, messages, tokens, start = await self.aengine.call(read)
        assert turn == base_turn + 1, f"turn {turn} after base {base_turn}"
        return PreparedTurn(
            conversation_id, cache_salt, base_turn, turn, messages, tokens[start:], len(tokens), tokens_digest(tokens)
        )

    async def commit(self, turn: PreparedTurn) -> None:
        """The service accepted the turn: the prepared state stays as the head (already is)."""

    async def abandon(self, turn: PreparedTurn) -> None:
        """The service refused the turn: go back to the base turn's head (or forget it all)."""

        def rewind(_e) -> None:
            key = conversation_key(turn.conversation_id, turn.cache_salt)
            conv = self.cache.conversations.get(key)
            if conv is None:
                return
            if turn.base_turn and conv.turn >= turn.base_turn:
                self.cache.rewind(turn.conversation_id, turn.cache_salt, turn.base_turn)
            else:
                self.cache.delete(turn.conversation_id, turn.cache_salt)

        await self.aengine.call(rewind)

    def token_text(self, token_id: int) -> str:
        return self.cache.engine.tokenizer.decode_exact([token_id])


def _matches(tokens: list[int], head: HeadRef) -> bool:
    return len(tokens) == head.committed_tokens and tokens_digest(tokens) == head.tokens_sha256
