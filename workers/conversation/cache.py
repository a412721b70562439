"""`ConversationCache`: the one front the worker (and in-process callers) use for conversations.

It holds the engine's ledgers (`conversations`, by key) and hands each operation what it
needs, never itself:

    turn_lifecycle.py  begin_turn, regenerate, commit, abandon (the turn lifecycle)
    recovery.py        adopt_ledger, materialize_head
    history.py         rewind, fork, delete, describe
    export.py          snapshot_head, remember_chunks; export_install.py: install_head
    retention.py       which heads a conversation keeps

Everything here runs on the engine thread (see `workers.async_engine.AsyncEngine.call`);
the API is documented in API.md next to this file.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from proto.contract import ConversationRef, ModelIdentity
from workers.state_names import HolderKind
from workers.conversation import export, history
from workers.conversation.export_install import install_head
from workers.conversation.ledger import ConversationLedger, find_conversation
from workers.conversation.records import CommitMode, HeadInfo, LedgerState, LedgerTurn, TurnCommit
from workers.conversation.recovery import LedgerRecovery
from workers.conversation.retention import HeadRetention
from workers.conversation.turn_lifecycle import TurnLifecycle
from workers.engine import LLMEngine
from workers.request import Request
from workers.sampling import SamplingParams


class ConversationCache:
    def __init__(self, engine: LLMEngine, retain_turns: int = 1):
        self.engine = engine
        self.retention = HeadRetention(engine.caches.heads, retain_turns)
        self.retain_turns = retain_turns
        self.caches = engine.caches
        self.kv = engine.caches.kv
        self.states = engine.caches.states
        self.heads = engine.caches.heads
        self.conversations: dict[str, ConversationLedger] = {}
        self.counters: Counter[str] = Counter(
            {"hits": 0, "misses": 0, "tokens_reused": 0, "published": 0, "discarded": 0, "materialized": 0}
        )
        self.turns = TurnLifecycle(engine, self.conversations, self.retention, self.counters)
        self.recovery = LedgerRecovery(engine, self.conversations, self.retention, self.counters)
        self.pending = self.turns.pending  # request id -> a turn begun and not finished
        self._prepared = self.turns.prepared_turns  # request id -> a turn awaiting its verdict
        self.materializing = self.recovery.materializing  # request id -> a head rebuild

    # -- turns (see turn_lifecycle.py) ------------------------------------------------------------
    def begin_turn(
        self,
        ref: ConversationRef,
        suffix: list[dict[str, Any]],
        params: SamplingParams,
        request_id: str,
        *,
        base_turn: int | None = None,
        commit: CommitMode = CommitMode.AT_ONCE,
        tools: list[dict[str, Any]] | None = None,
    ) -> Request:
        """Start a turn continuing `base_turn` (default: the latest) with the new suffix messages
        (`tools`: the request's function tools, rendered by the chat template)."""
        return self.turns.begin_turn(
            ref, suffix, params, request_id, base_turn=base_turn, commit=commit, tools=tools)

    def regenerate(
        self,
        ref: ConversationRef,
        params: SamplingParams,
        request_id: str,
        *,
        commit: CommitMode = CommitMode.AT_ONCE,
        tools: list[dict[str, Any]] | None = None,
    ) -> Request:
        """Re-run the last turn from the previous head, replacing it on commit (`tools`: the
        conversation's, as its turns sent them)."""
        return self.turns.regenerate(ref, params, request_id, commit=commit, tools=tools)

    def prepared(self, request_id: str) -> TurnCommit | None:
        return self.turns.prepared(request_id)

    def commit(self, record: TurnCommit) -> HeadInfo:
        """Make a prepared turn the conversation's head (no copy), then append it to the ledger."""
        return self.turns.commit(record)

    def abandon(self, record: TurnCommit) -> None:
        """Free a prepared turn; the base head and the ledger stay exactly as they were."""
        self.turns.abandon(record)

    # -- ledger of record, recovery and exports (see recovery.py, export.py) -----------------------
    def adopt_ledger(self, ref: ConversationRef, *, version: int, turns: list[LedgerTurn]) -> None:
        self.recovery.adopt_ledger(ref, version, turns)

    def materialize_head(
        self, ref: ConversationRef, request_id: str, *, canonical: bool = False
    ) -> Request | None:
        return self.recovery.materialize_head(ref, request_id, canonical)

    def snapshot_head(self, ref: ConversationRef) -> export.HeadSnapshot:
        return export.snapshot_head(self.engine, self.conversation_of(ref))

    def install_head(self, ref: ConversationRef, verified: export.VerifiedHead) -> HeadInfo:
        return install_head(self.engine, self.conversations, self.retention, ref, verified)

    def export_identity(self) -> tuple[ModelIdentity, dict[str, Any]]:
        """What `export.verify_export` checks a foreign export against."""
        return self.engine.identity, export.engine_layout(self.engine)

    def held_chunk_digests(self) -> set[str]:
        return self.caches.chunks.held_digests()

    def remember_chunks(self, snapshot: export.HeadSnapshot, exported: export.ExportedHead) -> None:
        export.remember_chunks(self.caches.chunks, snapshot, exported)

    # -- what this engine holds ---------------------------------------------------------------------
    def ledger_state(self, ref: ConversationRef) -> LedgerState | None:
        """The engine's ledger of the conversation (None if it holds none); touches no head."""
        conv = self.conversations.get(ref.key)
        if conv is None:
            return None
        return LedgerState(conv.version, conv.turn, tuple(conv.token_ids), busy=conv.in_flight is not None)

    def idle_head_tokens(self, ref: ConversationRef, version: int, turn: int) -> list[int] | None:
        """The committed token ids if the conversation is idle at exactly (`version`, `turn`) and
        the head of that turn is held (touched: it is about to serve); else None."""
        conv = self.conversations.get(ref.key)
        if conv is None or conv.in_flight is not None or (conv.version, conv.turn) != (version, turn):
            return None
        return list(conv.token_ids) if self.heads.find(ref.key, conv.turn) is not None else None

    def head_count(self, ref: ConversationRef | None = None) -> int:
        """Heads held: all of them, or the conversation's."""
        if ref is None:
            return len(self.heads)
        return len(self.heads.of_conversation(ref.key))

    def drop_headless_ledgers(self, keep: Iterable[ConversationRef] = ()) -> int:
        """Forget the ledgers of conversations that hold no head here and have no turn (or head
        rebuild) in flight, except those in `keep`; returns how many. Only for a caller whose
        ledgers are a cache of a record kept elsewhere (the worker: the cache service's ledger,
        read again when a turn needs it); in-process callers never call it, their ledger is the
        record. O(conversations + heads)."""
        kept = {h.conversation_key for h in self.heads.all()} | {ref.key for ref in keep}
        gone = [key for key, conv in self.conversations.items() if conv.in_flight is None and key not in kept]
        for key in gone:
            del self.conversations[key]
        return len(gone)

    # -- history operations (see history.py) ----------------------------------------------------------
    def conversation_of(self, ref: ConversationRef) -> ConversationLedger:
        return find_conversation(self.conversations, ref)

    def rewind(self, ref: ConversationRef, turn: int) -> None:
        """Forget turns after `turn`; the head of `turn` is used if it is still retained."""
        history.rewind(self.heads, self.conversation_of(ref), turn)

    def fork(self, ref: ConversationRef, turn: int, new_conversation_id: str) -> None:
        """A new conversation `new_conversation_id` (same salt) whose history is turns 1..turn;
        KV blocks are shared by reference.

        All-or-nothing: OutOfCacheError (no room for the head's state copies) changes nothing."""
        history.fork(self.caches, self.conversations, self.conversation_of(ref), turn, new_conversation_id)

    def delete(self, ref: ConversationRef) -> None:
        history.delete(self.heads, self.conversations, self.conversation_of(ref))

    def describe(self, ref: ConversationRef) -> dict[str, Any]:
        return history.describe(self.heads, self.conversation_of(ref))

    def stats(self) -> dict[str, int]:
        detached = self.heads.counters["detached"]
        return {
            **self.counters,
            "hits": self.counters["hits"] - detached,
            "misses": self.counters["misses"] + detached,
            "detached": detached,
            "evictions": self.heads.counters["evictions"],
            "tool_pause_evictions": self.heads.counters["tool_pause_evictions"],
            "prepared": len(self._prepared),
            "prepared_expired": self.heads.counters["prepared_expired"],
            "cow_block_copies": self.caches.counters["cow_block_copies"],
            "state_copies": self.caches.counters["state_copies"],
            "heads": len(self.heads),
            "ledgers": len(self.conversations),
            "head_bytes": self.heads.bytes_used(),
            "head_budget_bytes": self.heads.budget_bytes,
            # prefix checkpoints (workers/cache/prefix_index.py)
            "checkpoints": len(self.heads.checkpoints),
            "checkpoints_made": self.heads.counters["checkpoints_made"],
            "checkpoint_evictions": self.heads.counters["checkpoint_evictions"],
            "prefix_hits": self.heads.counters["prefix_hits"],
            "prefix_misses": self.heads.counters["prefix_misses"],
            "checkpoint_bytes": self.heads.bytes_used(HolderKind.CHECKPOINT),
        }
