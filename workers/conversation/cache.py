"""`ConversationCache`: the one front the worker (and in-process callers) use for conversations.

It holds the engine's ledgers (by conversation key) and hands each operation what it needs,
never itself; callers see only its methods (the engine's grammars, tokenizer and pools stay
behind it). Where each operation lives:

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
from collections.abc import Iterable, Sequence
from typing import Any

from proto.contract import ConversationRef, ModelIdentity
from workers.cache.heads import CommittedHead
from workers.conversation import export, history
from workers.conversation.boundaries import message_marks, reply_label
from workers.conversation.export_install import install_head
from workers.conversation.ledger import ConversationLedger, find_conversation
from workers.conversation.prompt import build_turn_prompt
from workers.conversation.records import CommitMode, HeadInfo, LedgerState, LedgerTurn, TurnCommit
from workers.conversation.recovery import LedgerRecovery
from workers.conversation.retention import HeadRetention
from workers.conversation.turn_lifecycle import TurnLifecycle
from workers.engine import LLMEngine
from workers.grammar.constraint import Constraint
from workers.request import CheckpointMark, KeepState, Request
from workers.sampling import SamplingParams
from workers.state_names import HolderKind
from workers.template_options import DEFAULT_TEMPLATE, TemplateOptions
from workers.tools.formats import ToolFormat


class ConversationCache:
    def __init__(self, engine: LLMEngine, retain_turns: int = 1):
        self._engine = engine
        self._caches = engine.caches
        self._heads = engine.caches.heads
        self._retention = HeadRetention(self._heads, retain_turns)
        self._conversations: dict[str, ConversationLedger] = {}
        self._counters: Counter[str] = Counter(
            {"hits": 0, "misses": 0, "tokens_reused": 0, "published": 0, "discarded": 0, "materialized": 0}
        )
        self._turns = TurnLifecycle(engine, self._conversations, self._retention, self._counters)
        self._recovery = LedgerRecovery(engine, self._conversations, self._retention, self._counters)

    @property
    def engine(self) -> LLMEngine:
        """The engine this cache serves, for in-process callers that drive it themselves (tests,
        the CLI, benchmarks: step, add_request). The worker uses the methods below instead."""
        return self._engine

    # -- the model's text ---------------------------------------------------------------------------
    @property
    def tool_format(self) -> ToolFormat:
        """The form this model's chat template writes tool calls in."""
        return self._engine.tool_format

    def token_text(self, token_id: int) -> str:
        """One token's exact text (may be part of a character)."""
        return self._engine.tokenizer.decode_exact([token_id])

    def prepare_grammar(self, constraint: Constraint) -> None:
        """Compile and check a constrained request's grammar (cached). Off-thread: it touches no
        engine state, so a bad schema is refused before the request reaches the engine thread."""
        self._engine.grammars.prepare(constraint)
        self._engine.check_constraint(constraint)

    # -- a request without a conversation ------------------------------------------------------------
    def begin_stateless(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams,
        request_id: str,
        cache_salt: str,
        tools: list[dict[str, Any]] | None = None,
        template: TemplateOptions = DEFAULT_TEMPLATE,
    ) -> Request:
        """A full-history request: it attaches the longest prefix of its prompt held here under
        `cache_salt`, checkpoints its message boundaries and its end (the final output's
        `checkpoints`, labelled by the messages they cover, see boundaries.py)."""
        tokenizer = self._engine.tokenizer
        prompt = self.stateless_prompt(messages, tools, template)
        return self._engine.add_request(
            request_id, prompt, params, prefix_scope=cache_salt, keep=KeepState.CHECKPOINT,
            marks=message_marks(tokenizer, messages, prompt, tools, template.kwargs),
            final_label=reply_label(messages))

    def stateless_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                         template: TemplateOptions = DEFAULT_TEMPLATE) -> list[int]:
        """A full-history request's prompt ids (any thread: the tokenizer only)."""
        return build_turn_prompt(self._engine.tokenizer, [], [], messages, tools, template).token_ids

    def begin_completion(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str,
                         cache_salt: str) -> Request:
        """A legacy completion's raw prompt (its text tokenized as is, no template): like a
        stateless request it attaches the longest prefix held under `cache_salt`, and keeps the
        state before its last token (label 1: the prompt, which a repeat of it reuses) and its
        end (label 2: the prompt and the reply, which a prompt extending both reuses)."""
        ids = self._engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        marks = (CheckpointMark(len(ids) - 1, label=1),) if len(ids) > 1 else ()
        return self._engine.add_request(request_id, ids, params, prefix_scope=cache_salt, keep=KeepState.CHECKPOINT,
                                        marks=marks, final_label=2)

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
        template: TemplateOptions = DEFAULT_TEMPLATE,
    ) -> Request:
        """Start a turn continuing `base_turn` (default: the latest) with the new suffix messages
        (`tools`: the request's function tools, rendered by the chat template; `template`: its
        chat_template_kwargs, the whole history rendered with them)."""
        return self._turns.begin_turn(
            ref, suffix, params, request_id, base_turn=base_turn, commit=commit, tools=tools, template=template)

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
        return self._turns.regenerate(ref, params, request_id, commit=commit, tools=tools)

    def prepared(self, request_id: str) -> TurnCommit | None:
        return self._turns.prepared(request_id)

    def commit(self, record: TurnCommit) -> HeadInfo:
        """Make a prepared turn the conversation's head (no copy), then append it to the ledger."""
        return self._turns.commit(record)

    def abandon(self, record: TurnCommit) -> None:
        """Free a prepared turn; the base head and the ledger stay exactly as they were."""
        self._turns.abandon(record)

    # -- ledger of record, recovery and exports (see recovery.py, export.py) -----------------------
    def adopt_ledger(self, ref: ConversationRef, *, version: int, turns: list[LedgerTurn]) -> None:
        self._recovery.adopt_ledger(ref, version, turns)

    def materialize_head(
        self, ref: ConversationRef, request_id: str, *, canonical: bool = False
    ) -> Request | None:
        return self._recovery.materialize_head(ref, request_id, canonical)

    def snapshot_head(self, ref: ConversationRef) -> export.HeadSnapshot:
        return export.snapshot_head(self._engine, self.conversation_of(ref))

    def install_head(self, ref: ConversationRef, verified: export.VerifiedHead) -> HeadInfo:
        return install_head(self._engine, self._conversations, self._retention, ref, verified)

    def mark_in_tier(self, ref: ConversationRef, version: int) -> None:
        """The state tier holds the conversation's head of `version` (exported or imported): under
        pressure it is evicted before heads held only here, since the next turn imports it."""
        for head in self._heads.of_conversation(ref.key):
            if head.version == version:
                head.in_tier = True

    def export_identity(self) -> tuple[ModelIdentity, dict[str, Any]]:
        """What `export.verify_export` checks a foreign export against."""
        return self._engine.identity, export.engine_layout(self._engine)

    def held_chunk_digests(self) -> set[str]:
        return self._caches.chunks.held_digests()

    def remember_chunks(self, snapshot: export.HeadSnapshot, exported: export.ExportedHead) -> None:
        export.remember_chunks(self._caches.chunks, snapshot, exported)

    # -- what this engine holds ---------------------------------------------------------------------
    def ledger_state(self, ref: ConversationRef) -> LedgerState | None:
        """The engine's ledger of the conversation (None if it holds none); touches no head."""
        conv = self._conversations.get(ref.key)
        if conv is None:
            return None
        return LedgerState(conv.version, conv.turn, tuple(conv.token_ids), busy=conv.in_flight is not None)

    def idle_head_tokens(self, ref: ConversationRef, version: int, turn: int) -> list[int] | None:
        """The committed token ids if the conversation is idle at exactly (`version`, `turn`) and
        the head of that turn is held (touched: it is about to serve); else None."""
        conv = self._conversations.get(ref.key)
        if conv is None or conv.in_flight is not None or (conv.version, conv.turn) != (version, turn):
            return None
        return list(conv.token_ids) if self._heads.find(ref.key, conv.turn) is not None else None

    def head_count(self, ref: ConversationRef | None = None) -> int:
        """Heads held: all of them, or the conversation's."""
        if ref is None:
            return len(self._heads)
        return len(self._heads.of_conversation(ref.key))

    def drop_headless_ledgers(self, keep: Iterable[ConversationRef] = ()) -> int:
        """Forget the ledgers of conversations that hold no head here and have no turn (or head
        rebuild) in flight, except those in `keep`; returns how many. Only for a caller whose
        ledgers are a cache of a record kept elsewhere (the worker: the cache service's ledger,
        read again when a turn needs it); in-process callers never call it, their ledger is the
        record. O(conversations + heads)."""
        kept = {h.conversation_key for h in self._heads.all()} | {ref.key for ref in keep}
        gone = [key for key, conv in self._conversations.items() if conv.in_flight is None and key not in kept]
        for key in gone:
            del self._conversations[key]
        return len(gone)

    def ledger(self, ref: ConversationRef) -> ConversationLedger | None:
        """The engine's ledger of the conversation (None if it holds none), to read: its
        turns, messages and token ids. Change it only through the methods of this class."""
        return self._conversations.get(ref.key)

    def head_of(self, ref: ConversationRef, turn: int | None = None) -> CommittedHead | None:
        """The held head of `turn` (default: the ledger's latest), without touching the LRU order."""
        conv = self._conversations.get(ref.key)
        turn = conv.turn if turn is None and conv is not None else turn
        return next((h for h in self._heads.of_conversation(ref.key) if h.turn == turn), None)

    def pending_turns(self) -> set[str]:
        """Request ids of the turns and head rebuilds begun here and not finished yet."""
        return set(self._turns.pending) | set(self._recovery.materializing)

    # -- integrity (for tests and debugging) -----------------------------------------------------------
    def check_integrity(self) -> None:
        """The engine's pool checks, then: heads own exactly what the managers say heads hold,
        each head's KV table and slots match its length."""
        self._engine.check_integrity()  # includes: every head-held block or slot belongs to a known head
        kv, states = self._caches.kv, self._caches.states
        block = self._engine.kv_layout.block_size
        holders = {h.holder for h in self._heads.all()}
        assert {h for h in kv.tables if h.kind is HolderKind.HEAD} == holders, "KV blocks of no head (leak)"
        assert {h for h in states.slots if h.kind is HolderKind.HEAD} == holders, "state slots of no head (leak)"
        for head in self._heads.all():
            assert len(kv.table(head.holder)) == -(-head.state_len // block), head
            assert len(states.slots[head.holder]) == 2, head
            assert head.aligned_len <= head.state_len and head.aligned_len % block == 0, head

    def check_settled(self) -> None:
        """Nothing in flight: no turn pending or prepared, no head pinned, no ledger busy (for a
        caller that has resolved every turn it began, once the engine is idle)."""
        assert not self._turns.pending, self._turns.pending
        assert not self._turns.prepared_turns and not self._heads.prepared, "a prepared turn was never resolved"
        assert all(h.pins == 0 for h in self._heads.all())
        assert all(c.in_flight is None for c in self._conversations.values())

    # -- history operations (see history.py) ----------------------------------------------------------
    def conversation_of(self, ref: ConversationRef) -> ConversationLedger:
        return find_conversation(self._conversations, ref)

    def rewind(self, ref: ConversationRef, turn: int) -> None:
        """Forget turns after `turn`; the head of `turn` is used if it is still retained."""
        history.rewind(self._heads, self.conversation_of(ref), turn)

    def fork(self, ref: ConversationRef, turn: int, new_conversation_id: str) -> None:
        """A new conversation `new_conversation_id` (same salt) whose history is turns 1..turn;
        KV blocks are shared by reference.

        All-or-nothing: OutOfCacheError (no room for the head's state copies) changes nothing."""
        history.fork(self._caches, self._conversations, self.conversation_of(ref), turn, new_conversation_id)

    def cut_to_aligned(self, ref: ConversationRef, turn: int) -> tuple[int, int]:
        """Cut the head of `turn` back to its last block boundary, as a block-aligned cache keeps
        it (what bench.conversation measures that reuse with); (committed, aligned) lengths."""
        return history.cut_to_aligned(self._engine, self.conversation_of(ref), turn)

    def delete(self, ref: ConversationRef) -> None:
        history.delete(self._heads, self._conversations, self.conversation_of(ref))

    def describe(self, ref: ConversationRef) -> dict[str, Any]:
        return history.describe(self._heads, self.conversation_of(ref))

    def stats(self) -> dict[str, int]:
        detached = self._heads.counters["detached"]
        return {
            **self._counters,
            "hits": self._counters["hits"] - detached,
            "misses": self._counters["misses"] + detached,
            "detached": detached,
            "evictions": self._heads.counters["evictions"],
            "tool_pause_evictions": self._heads.counters["tool_pause_evictions"],
            "prepared": len(self._turns.prepared_turns),
            "prepared_expired": self._heads.counters["prepared_expired"],
            "cow_block_copies": self._caches.counters["cow_block_copies"],
            "state_copies": self._caches.counters["state_copies"],
            "heads": len(self._heads),
            "ledgers": len(self._conversations),
            "head_bytes": self._heads.bytes_used(),
            "head_budget_bytes": self._heads.budget_bytes,
            # prefix checkpoints (workers/cache/prefix_index.py)
            "checkpoints": len(self._heads.checkpoints),
            "checkpoints_made": self._heads.counters["checkpoints_made"],
            "checkpoint_evictions": self._heads.counters["checkpoint_evictions"],
            "prefix_hits": self._heads.counters["prefix_hits"],
            "prefix_misses": self._heads.counters["prefix_misses"],
            "checkpoint_bytes": self._heads.bytes_used(HolderKind.CHECKPOINT),
        }
