"""The vLLM backend's conversations: what our engine's conversation cache keeps, over heads an
engine host holds. Event loop only (the host is reached by its async calls).

Each conversation keeps its ledger (token ids are authoritative), its committed head here (the
latest turn only) and its prepared turn. A head is vLLM's KV blocks and Mamba state pages after
the committed tokens but the last one, loaded into a turn's request by our KV connector and
captured at its end. Two-phase as on our engine, by the same rules (workers/conversation/two_phase.py):

    begin     the turn loads the head (if held): state_len tokens; the rest runs
    prepare   the end is captured *prepared* in the host; a TurnCommit describes it
    commit    the prepared state becomes the conversation's head (the older one is dropped)
    abandon   the prepared state is dropped; the head it continued was never written
    expire    unresolved after prepared_turn_timeout_s (as our engine's): abandoned

Heads of idle conversations beyond head_cache_mb go, least recently used first (lru_budget.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from proto.contract import ConversationRef, ModelIdentity, tokens_digest
from workers.config import CacheConfig
from workers.conversation.export_format import pack_export
from workers.conversation.ledger import ConversationLedger
from workers.conversation.records import HeadInfo, LedgerTurn, Resolution, TurnCommit
from workers.conversation.two_phase import PreparedTurns, commit_to_ledger, end_turn
from workers.errors import ConversationNotFoundError, CorruptStateError, EngineShutdownError, TurnResolvedError
from workers.request import FinishReason
from workers.tokenizer import ChatTokenizer
from workers.vllm_backend import export as vllm_export
from workers.vllm_backend.engine_host import EngineHost
from workers.vllm_backend.lru_budget import LruBudget

PREPARED_TURN_TIMEOUT_S = CacheConfig.prepared_turn_timeout_s  # as our engine's: an unresolved turn is abandoned


@dataclass
class HostedHead:
    """A committed head held by the engine host."""

    head_id: str
    turn: int
    version: int
    state_len: int  # = the turn's committed tokens - 1
    tokens_digest: str  # of the committed tokens of `turn`
    nbytes: int


@dataclass
class PreparedTurn:
    record: TurnCommit
    expiry: asyncio.TimerHandle


class HostedConversations:
    def __init__(self, host: EngineHost, head_budget_bytes: int, tokenizer: ChatTokenizer,
                 eos_token_ids: frozenset[int]):
        self.host = host
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.ledgers: dict[str, ConversationLedger] = {}
        # conversation key -> its head here; a conversation's turn in flight pins it
        self.heads: LruBudget[str, HostedHead] = LruBudget(head_budget_bytes, lambda h: h.nbytes, self._busy)
        self.prepared: PreparedTurns[PreparedTurn] = PreparedTurns()
        self._numbers = itertools.count()

    def _busy(self, key: str, _head: HostedHead) -> bool:
        conv = self.ledgers.get(key)
        return conv is not None and conv.in_flight is not None

    # -- what the host holds ------------------------------------------------------------------
    def idle_head_tokens(self, key: str, version: int, turn: int) -> list[int] | None:
        """The committed tokens of the conversation if its ledger is idle at (version, turn) and
        its head here is of that turn (touched); else None."""
        conv, held = self.ledgers.get(key), self.heads.get(key)
        if conv is None or held is None or conv.in_flight is not None:
            return None
        if (conv.version, conv.turn, held.turn) != (version, turn, turn):
            return None
        self.heads.touch(key)
        return conv.token_ids

    def head_count(self, key: str | None = None) -> int:
        return len(self.heads) if key is None else int(key in self.heads)

    async def drop(self, key: str) -> None:
        """Forget the conversation here: its ledger and its head."""
        await self._drop_head(key)
        self.ledgers.pop(key, None)

    def drop_headless_ledgers(self, keep: Iterable[ConversationRef] = ()) -> int:
        """Forget the ledgers of conversations with no head held here and no turn in flight, but
        those in `keep` (a turn of theirs runs here, from its recovery to its verdict), as our
        engine does (workers/conversation/cache.py): the cache service's ledger is the record,
        read again when a turn needs it. Returns how many went."""
        kept = {key for key in self.ledgers if key in self.heads} | {ref.key for ref in keep}
        gone = [key for key, conv in self.ledgers.items() if conv.in_flight is None and key not in kept]
        for key in gone:
            del self.ledgers[key]
        return len(gone)

    async def forget_idle(self, refs: list[ConversationRef]) -> tuple[int, list[ConversationRef]]:
        """Drop these conversations but those with a turn awaiting its verdict: (dropped, busy)."""
        dropped, busy = 0, []
        for ref in refs:
            conv = self.ledgers.get(ref.key)
            if conv is not None and conv.in_flight is not None:
                busy.append(ref)
            elif conv is not None:
                await self.drop(ref.key)
                dropped += 1
        return dropped, busy

    async def adopt(self, ref: ConversationRef, version: int, turns: list[LedgerTurn]) -> None:
        """The service's ledger (checked by the caller) becomes this one; a head held here stays
        if the ledger still has its tokens (the next turn continues it and runs the turns after it)."""
        new = ConversationLedger(ref, version=version)
        for turn in turns:
            new.append([dict(m) for m in turn.messages], list(turn.token_ids))
        old = self.ledgers.get(ref.key)
        if old is not None:
            old.ensure_idle()
        held = self.heads.get(ref.key)
        if held is not None:
            if held.turn <= new.turn and tokens_digest(new.tokens_until(held.turn)) == held.tokens_digest:
                held.version = version if held.turn == new.turn else held.version
            else:
                await self._drop_head(ref.key)
        self.ledgers[ref.key] = new

    async def install(self, ref: ConversationRef, meta: dict[str, Any], parts: vllm_export.HeadParts) -> HeadInfo:
        """A head exported by another vLLM worker (verified) becomes this conversation's; the
        ledger must be adopted first."""
        conv, turn = self.ledgers.get(ref.key), meta["turn"]
        if (conv is None or meta["conversation"] != ref.key or not 1 <= turn <= conv.turn
                or len(conv.tokens_until(turn)) != meta["committed_tokens"]
                or tokens_digest(conv.tokens_until(turn)) != meta["tokens_digest"]):
            raise CorruptStateError("the export is not a head of this conversation's ledger")
        conv.ensure_idle()
        head_id = self._head_id(ref.key, turn)
        nbytes = await self.host.call("install", head=head_id, tokens=parts.state_len, blocks=parts.blocks,
                                      state=parts.state)
        await self._drop_head(ref.key)
        self.heads.put(ref.key, HostedHead(head_id, turn, meta["version"], parts.state_len, meta["tokens_digest"],
                                           nbytes))
        await self._keep_within_budget()
        return _head_info(conv, turn, parts.state_len)

    async def export(self, ref: ConversationRef, identity: ModelIdentity, layout: dict[str, Any]
                     ) -> tuple[int, list[bytes]]:
        """(head version, tier parts) of the conversation's head."""
        held, conv = self.heads.get(ref.key), self.ledgers.get(ref.key)
        if held is None or conv is None or held.turn != conv.turn:  # as our engine: the latest turn's head
            raise ConversationNotFoundError(f"no head of {ref.id!r}'s latest turn here")
        state_len, blocks, state = await self.host.export_head(held.head_id)
        committed = conv.tokens_until(held.turn)
        meta = {"conversation": ref.key, "turn": held.turn, "version": held.version,
                "committed_tokens": len(committed), "tokens_digest": tokens_digest(committed)}
        exported = await asyncio.to_thread(vllm_export.build_export, meta, identity, layout,
                                           vllm_export.HeadParts(state_len, blocks, state))
        return held.version, pack_export(exported)

    # -- turns --------------------------------------------------------------------------------
    def ledger_for_turn(self, ref: ConversationRef) -> ConversationLedger:
        """The ledger a new turn starts from (a new one for a new conversation): idle."""
        conv = self.ledgers.get(ref.key) or ConversationLedger(ref)
        conv.ensure_idle()
        return conv

    def begin(self, conv: ConversationLedger, request_id: str) -> tuple[str, int] | None:
        """The turn is in flight; returns the head it loads (host head id, tokens), if held."""
        held = self.heads.get(conv.key)
        self.ledgers[conv.key] = conv
        conv.in_flight = request_id
        return (held.head_id, held.state_len) if held is not None and held.turn <= conv.turn else None

    def prepare(self, conv: ConversationLedger, suffix: list[dict[str, Any]], prompt: list[int],
                output: list[int], frame: dict[str, Any], request_id: str) -> TurnCommit:
        """The finished turn's record: its state (frame["prepared"] tokens) awaits its verdict."""
        reason = FinishReason.STOP if frame["reason"] == "stop" else FinishReason.LENGTH
        reply_ids = output[:-1] if reason is FinishReason.STOP and output and output[-1] in self.eos_token_ids else output
        committed = prompt + output
        if frame["prepared"] != len(committed) - 1:  # the state must cover all committed tokens but the last
            raise CorruptStateError(f"captured {frame['prepared']} tokens of state for {len(committed)} committed")
        start = len(conv.token_ids)
        record = TurnCommit(
            request_id=request_id, conversation=conv.ref, base_version=conv.version, base_turn=conv.turn,
            start=start, token_ids=tuple(committed[start:]),
            messages=(*suffix, {"role": "assistant", "content": self.tokenizer.decode_exact(reply_ids)}),
            committed_tokens=len(committed), tokens_digest=tokens_digest(committed), state_len=frame["prepared"],
            finish_reason=reason)
        expiry = asyncio.get_running_loop().call_later(
            PREPARED_TURN_TIMEOUT_S, lambda: asyncio.ensure_future(self._expire(record)))
        self.prepared.add(PreparedTurn(record, expiry))
        return record

    async def commit(self, record: TurnCommit) -> HeadInfo:
        self._take(record, "commit")
        conv = self.ledgers[record.conversation.key]
        head_id = self._head_id(conv.key, record.base_turn + 1)
        try:
            nbytes = await self.host.call("commit", id=record.request_id, head=head_id)
        except ValueError as e:
            self.end_turn(conv)
            raise TurnResolvedError(f"cannot commit turn {record.request_id!r}: {e}") from e
        except BaseException:  # the host died: the turn's state is gone with it
            self.end_turn(conv)
            raise
        self.prepared.resolve(record, Resolution.COMMITTED)
        await self._drop_head(conv.key)
        turn = commit_to_ledger(conv, record)
        self.heads.put(conv.key, HostedHead(head_id, turn, conv.version, record.state_len, record.tokens_digest,
                                            nbytes))
        self.end_turn(conv)
        await self._keep_within_budget()
        return _head_info(conv, turn, record.state_len)

    async def abandon(self, record: TurnCommit, how: Resolution = Resolution.ABANDONED) -> None:
        self._take(record, "abandon")
        self.prepared.resolve(record, how)
        try:
            await self.host.call("abandon", id=record.request_id)
        finally:
            self.end_turn(self.ledgers[record.conversation.key])

    async def _expire(self, record: TurnCommit) -> None:
        if self.prepared.get(record.request_id) is not None:
            try:
                await self.abandon(record, Resolution.EXPIRED)
            except (TurnResolvedError, EngineShutdownError):  # resolved meanwhile, or its state died with the host
                return

    def _take(self, record: TurnCommit, how: str) -> None:
        """The turn stops being prepared here (its timer too) before the host is asked."""
        entry = self.prepared.entry(record, how)
        self.prepared.discard(record.request_id)
        entry.expiry.cancel()

    def end_turn(self, conv: ConversationLedger) -> None:
        end_turn(self.ledgers, conv, conv.key in self.heads)

    # -- heads --------------------------------------------------------------------------------
    def _head_id(self, key: str, turn: int) -> str:
        return f"{key}/{turn}/{next(self._numbers)}"

    async def _drop_head(self, key: str) -> None:
        held = self.heads.pop(key)
        if held is not None:
            await self.host.call("drop", heads=[held.head_id])

    async def _keep_within_budget(self) -> None:
        """Least recently used heads of idle conversations go beyond head_cache_mb (chosen and
        taken at once: another call may run at the await)."""
        victims = [h.head_id for h in self.heads.over_budget()]
        if victims:
            await self.host.call("drop", heads=victims)


def _head_info(conv: ConversationLedger, turn: int, state_len: int) -> HeadInfo:
    committed = conv.tokens_until(turn)
    return HeadInfo(conv.key, turn, conv.version, len(committed), tokens_digest(committed), state_len, state_len)
