"""The turn lifecycle inside one engine: begin, prepare on success, commit or abandon.

    begin_turn:  ledger tokens + template delta of the suffix  -> prompt
                 committed head (if retained; else the latest earlier one) pinned and
                 attached -> num_computed = state_len
    finish       STOP/LENGTH: the request's state is kept *prepared* (base head intact),
                 a TurnCommit record describes it; ABORT/ERROR: the state is freed
    commit:      the prepared state becomes the head (no copy), then the ledger appends the
                 turn and heads beyond the last K turns are released
    abandon:     the prepared state is freed; the base head is byte-identical

`CommitMode.AT_ONCE` commits as soon as the turn finishes (in-process use); the worker uses
`CommitMode.PREPARE` and commits only after the cache service accepted the turn.
Runs on the engine thread (see `workers.async_engine.AsyncEngine.call`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from proto.contract import ConversationRef
from workers.cache.heads import CommittedHead
from workers.conversation.boundaries import message_marks
from workers.conversation.ledger import ConversationLedger, find_conversation
from workers.conversation.prompt import build_turn_prompt
from workers.conversation.records import CommitMode, HeadInfo, Resolution, TurnCommit, TurnOutcome
from workers.conversation.retention import HeadRetention
from workers.conversation.turn_state import PendingTurn, PreparedTurn, turn_record
from workers.conversation.two_phase import PreparedTurns, commit_to_ledger, end_turn
from workers.engine import LLMEngine
from workers.errors import ConversationNotFoundError, InvalidRequestError
from workers.request import KeepState, Request
from workers.sampling import SamplingParams
from workers.template_options import DEFAULT_TEMPLATE, TemplateOptions
from workers.tools.formats import plain_message


class TurnLifecycle:
    """Turns between their start and their resolution, over the engine's ledgers and heads."""

    def __init__(
        self,
        engine: LLMEngine,
        conversations: dict[str, ConversationLedger],
        retention: HeadRetention,
        counters: Counter[str],
    ):
        self.engine = engine
        self.conversations = conversations
        self.heads = retention.heads
        self.retention = retention
        self.counters = counters
        self.pending: dict[str, PendingTurn] = {}
        self.prepared_turns: PreparedTurns[PreparedTurn] = PreparedTurns()

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
        if not suffix:
            raise InvalidRequestError("a turn needs at least one new message")
        if not template.opens_reply:  # the reply is committed as a new assistant message (ingress: 400)
            raise InvalidRequestError("a conversation turn's prompt ends with the generation prompt")
        if not isinstance(commit, CommitMode):
            raise InvalidRequestError(f"commit must be a CommitMode, got {commit!r}")
        key = ref.key
        conv = self.conversations.get(key) or ConversationLedger(ref)
        conv.ensure_idle()
        base = conv.turn if base_turn is None else base_turn
        if isinstance(base, bool) or not isinstance(base, int) or not 0 <= base <= conv.turn:
            raise ConversationNotFoundError(f"conversation {ref.id!r} has no turn {base!r}")
        committed = conv.tokens_until(base)
        history_messages = [m for t in conv.turns[:base] for m in t.messages]
        # The ledger keeps role and content: a suffix's tool calls become the text they render to.
        suffix = [plain_message(m, self.engine.tool_format) for m in suffix]
        prompt = build_turn_prompt(self.engine.tokenizer, committed, history_messages, suffix, tools,
                                   template).token_ids
        head = self._head_to_continue(key, base)
        replacing = self.heads.find(key, base + 1, touch=False)  # a regenerated turn's old head
        # Without a head the engine attaches the longest prefix held under the salt (a shared
        # system prompt, a stateless request's state); a first turn marks its message boundaries.
        marks = message_marks(self.engine.tokenizer, suffix, prompt, tools, template.kwargs) if base == 0 else ()
        request = self.engine.add_request(
            request_id,
            prompt,
            params,
            head=head.attachment() if head else None,
            keep=KeepState.PREPARE,
            on_finished=self._on_finished,
            prefix_scope=ref.salt,
            marks=marks,
        )
        if base:  # a deterministic turn cannot use a head the fast path made: the engine drops it
            self.counters["hits" if request.head else "misses"] += 1
        self.conversations[key] = conv
        conv.in_flight = request_id
        self.pending[request_id] = PendingTurn(
            key, base, conv.version, tuple(suffix), len(committed), commit, replacing)
        return request

    def _head_to_continue(self, key: str, base: int) -> CommittedHead | None:
        """The head of turn `base`, or else the latest one held before it. A conversation's tokens
        only grow, so an earlier turn's state covers a prefix of this prompt and only the turns
        after it run again: the case of a head whose conversation went on elsewhere (another
        replica served the next turns) or of a tier copy older than the ledger (its export had
        not run when the owner died)."""
        return self.heads.latest(key, at_most=base) if base else None

    def regenerate(
        self,
        ref: ConversationRef,
        params: SamplingParams,
        request_id: str,
        *,
        commit: CommitMode = CommitMode.AT_ONCE,
        tools: list[dict[str, Any]] | None = None,
    ) -> Request:
        conv = find_conversation(self.conversations, ref)
        if conv.turn == 0:
            raise ConversationNotFoundError(f"conversation {ref.id!r} has no turn to regenerate")
        suffix = conv.turns[-1].messages[:-1]  # the turn's messages without its reply
        return self.begin_turn(ref, suffix, params, request_id, base_turn=conv.turn - 1, commit=commit, tools=tools)

    def _on_finished(self, request: Request) -> TurnCommit | None:
        """Called by the engine when a turn's request ends, however it ends."""
        pending = self.pending.pop(request.request_id)
        conv = self.conversations[pending.key]
        if request.prepared is None:  # aborted or failed: the engine already freed its state
            self._end_turn(conv, TurnOutcome.DISCARDED)
            return None
        try:
            record = turn_record(self.engine, conv, pending, request)
        except BaseException:
            self._end_turn(conv, TurnOutcome.DISCARDED)  # the engine frees the prepared state
            raise
        self.prepared_turns.add(PreparedTurn(record, request.prepared, request.num_cached_tokens, pending.replacing))
        request.prepared.on_expire = lambda state: self._expired(record)
        if pending.mode is CommitMode.AT_ONCE:
            try:
                self.commit(record)
            except BaseException:  # the engine frees the prepared state; the turn is discarded
                self.prepared_turns.discard(request.request_id)
                self._end_turn(conv, TurnOutcome.DISCARDED)
                raise
        return record

    def prepared(self, request_id: str) -> TurnCommit | None:
        entry = self.prepared_turns.get(request_id)
        return None if entry is None else entry.record

    def commit(self, record: TurnCommit) -> HeadInfo:
        entry = self.prepared_turns.entry(record, "commit")
        conv = self.conversations[record.conversation.key]
        turn = record.base_turn + 1
        # A regenerated turn replaces the head of that turn it saw begin (only once the state
        # has moved); a head that appeared meanwhile makes the commit refuse, changing nothing.
        head = self.heads.commit(entry.state, conv.key, turn, record.base_version + 1, replacing=entry.replacing)
        for stale in [h for h in self.heads.of_conversation(conv.key) if h.turn > turn]:
            self.heads.drop(stale)  # heads of turns the new one cuts off
        # The state has moved; only now does the ledger change (pure list operations).
        self.prepared_turns.resolve(record, Resolution.COMMITTED)
        commit_to_ledger(conv, record)
        self._end_turn(conv, TurnOutcome.PUBLISHED)
        self.counters["tokens_reused"] += entry.tokens_reused
        self.retention.retire_older(conv.key, turn)
        return conv.head_info(head)

    def abandon(self, record: TurnCommit) -> None:
        entry = self.prepared_turns.entry(record, "abandon")
        self.prepared_turns.resolve(record, Resolution.ABANDONED)
        self.heads.release(entry.state)
        self._end_turn(self.conversations[record.conversation.key], TurnOutcome.DISCARDED)

    def _expired(self, record: TurnCommit) -> None:
        """The head manager abandoned a prepared turn nobody resolved in time."""
        self.prepared_turns.resolve(record, Resolution.EXPIRED)
        self._end_turn(self.conversations[record.conversation.key], TurnOutcome.DISCARDED)

    def _end_turn(self, conv: ConversationLedger, outcome: TurnOutcome) -> None:
        self.counters[outcome.value] += 1
        end_turn(self.conversations, conv, bool(self.heads.of_conversation(conv.key)))
