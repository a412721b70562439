"""The turn lifecycle inside one engine: begin, publish on success, discard on failure.

    begin_turn:  ledger tokens + template delta of the suffix  -> prompt
                 committed head (if retained) pinned and attached -> num_computed = state_len
    publish:     the request's blocks and slots become the new head (no copy), the ledger
                 appends the turn, heads beyond the last K turns are released
    discard:     the request's state is freed; the previous head was never written

Everything here runs on the engine thread (see `workers.async_engine.AsyncEngine.call`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from workers.cache.holders import Holder
from workers.conversation.heads import CommittedHead, HeadStore
from workers.conversation.ledger import Conversation, conversation_key, tokens_digest
from workers.conversation.prompt import build_turn_prompt
from workers.engine import LLMEngine
from workers.errors import ConversationBusyError, ConversationNotFoundError, InvalidRequestError
from workers.request import FinishReason, HeadAttachment, Request, RequestStatus
from workers.sampling import SamplingParams


@dataclass
class PendingTurn:
    key: str
    base_turn: int  # the turn this one continues (0: none)
    suffix: list[dict[str, Any]]
    start: int  # where the new turn's tokens start in the ledger (0 after a template fallback)
    base_head: CommittedHead | None


class ConversationCache:
    def __init__(self, engine: LLMEngine, retain_turns: int = 1):
        if retain_turns < 1:
            raise ValueError("retain_turns must be >= 1")
        self.engine = engine
        self.retain_turns = retain_turns
        self.kv = engine.caches.kv
        self.states = engine.caches.states
        self.heads = HeadStore(self.kv, self.states, engine.config.cache.head_cache_bytes)
        self.conversations: dict[str, Conversation] = {}
        self.pending: dict[str, PendingTurn] = {}
        self.counters: Counter[str] = Counter(
            {"hits": 0, "misses": 0, "tokens_reused": 0, "published": 0, "discarded": 0, "detached": 0}
        )
        self._head_ids = itertools.count()
        self.heads.on_evict = self._on_evict
        self.heads.may_take_pinned = self._only_queued_on
        engine.finish_listeners.append(self._on_finished)

    # -- turns ----------------------------------------------------------------------------------
    def begin_turn(
        self,
        conversation_id: str,
        cache_salt: str,
        suffix: list[dict[str, Any]],
        params: SamplingParams,
        request_id: str,
        *,
        base_turn: int | None = None,
    ) -> Request:
        """Start a turn continuing `base_turn` (default: the latest) with the new suffix messages."""
        if not suffix:
            raise InvalidRequestError("a turn needs at least one new message")
        key = conversation_key(conversation_id, cache_salt)
        conv = self.conversations.get(key) or Conversation(key, conversation_id)
        if conv.in_flight is not None:
            raise ConversationBusyError(f"conversation {conversation_id!r} has a turn in flight")
        base = conv.turn if base_turn is None else base_turn
        if not 0 <= base <= conv.turn:
            raise ConversationNotFoundError(f"conversation {conversation_id!r} has no turn {base}")
        committed = conv.tokens_until(base)
        history = [m for t in conv.turns[:base] for m in t.messages]
        prompt = build_turn_prompt(self.engine.tokenizer, committed, history, suffix)
        head = self.heads.get(key, base) if base and prompt.reuses_committed else None
        attach = HeadAttachment(head.holder, head.state_len, head.aligned_len) if head else None
        request = self.engine.add_request(request_id, prompt.token_ids, params, head=attach, retain_state=True)
        if head is not None:
            head.pins += 1
        if base:
            self.counters["hits" if head else "misses"] += 1
        self.conversations[key] = conv
        conv.in_flight = request_id
        start = len(committed) if prompt.reuses_committed else 0
        self.pending[request_id] = PendingTurn(key, base, list(suffix), start, head)
        return request

    def regenerate(self, conversation_id: str, cache_salt: str, params: SamplingParams, request_id: str) -> Request:
        """Re-run the last turn from the previous head, replacing it on success."""
        conv = self._conversation(conversation_id, cache_salt)
        if conv.turn == 0:
            raise ConversationNotFoundError(f"conversation {conversation_id!r} has no turn to regenerate")
        suffix = conv.turns[-1].messages[:-1]  # the turn's messages without its reply
        return self.begin_turn(conversation_id, cache_salt, suffix, params, request_id, base_turn=conv.turn - 1)

    def _on_finished(self, request: Request) -> None:
        pending = self.pending.pop(request.request_id, None)
        if pending is None:
            return
        conv = self.conversations[pending.key]
        conv.in_flight = None
        if pending.base_head is not None:
            pending.base_head.pins -= 1
        if request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._publish(conv, pending, request)
        else:
            self.counters["discarded"] += 1  # the scheduler already freed the request's state
        if pending.base_head is not None or request.finish_reason is not None:
            self.heads.enforce_budget()

    def _only_queued_on(self, head: CommittedHead) -> bool:
        """Deadlock breaker: with nothing running, a head pinned only by queued turns may go."""
        scheduler = self.engine.scheduler
        if scheduler.running:
            return False  # the running turns will finish and free their blocks: wait for them
        front = scheduler.waiting[0] if scheduler.waiting else None
        if front is not None and front.head is not None and front.head.holder == head.holder:
            return False  # the turn being admitted needs this one; take those queued behind it
        requests = scheduler.requests
        return all(
            requests[rid].status is RequestStatus.WAITING
            for rid, pending in self.pending.items()
            if pending.base_head is head and rid in requests
        )

    def _on_evict(self, head: CommittedHead) -> None:
        """A head is evicted under pool pressure: turns still queued on it recompute instead."""
        for request_id, pending in self.pending.items():
            if pending.base_head is not head:
                continue
            pending.base_head = None
            request = self.engine.scheduler.requests.get(request_id)
            if request is None:
                continue
            # Its prompt holds every token: a queued (or later preempted) turn recomputes from 0.
            # A running one already holds its own block references and state copies.
            request.head = None
            if request.status is RequestStatus.WAITING:
                self.counters["hits"] -= 1
                self.counters["misses"] += 1
                self.counters["detached"] += 1
        head.pins = 0

    def _publish(self, conv: Conversation, pending: PendingTurn, request: Request) -> None:
        output = request.output_token_ids
        if request.finish_reason is FinishReason.STOP and output and output[-1] in self.engine.eos_token_ids:
            output = output[:-1]  # the template writes the end-of-turn token itself
        # Special tokens inside the reply stay: the content must render back to what the model saw.
        reply = {"role": "assistant", "content": self.engine.tokenizer.decode_exact(output)}
        if pending.start == 0 and pending.base_turn:
            for turn in conv.turns:  # template fallback: earlier turns' token ranges no longer apply
                turn.start = turn.end = 0
        conv.truncate(pending.base_turn)
        for stale in [h for h in self.heads.of_conversation(conv.key) if h.turn > pending.base_turn]:
            self.heads.drop(stale)  # a regenerated turn replaces the old one
        conv.append(pending.suffix + [reply], request.token_ids[pending.start :], pending.start)

        src = Holder.request(request.request_id)
        head = CommittedHead(
            holder=Holder.head(f"{conv.key}#{conv.turn}#{next(self._head_ids)}"),
            conversation_key=conv.key,
            turn=conv.turn,
            state_len=request.num_computed_tokens,
            aligned_len=request.aligned_len,
        )
        self.kv.truncate(src, head.state_len)
        self.kv.transfer(src, head.holder)
        self.states.transfer(src, head.holder)
        self.counters["published"] += 1
        self.counters["tokens_reused"] += request.num_cached_tokens
        for old in self.heads.of_conversation(conv.key):
            if old.turn <= conv.turn - self.retain_turns:
                self.heads.drop(old)
        self.heads.add(head)

    # -- ledger operations ------------------------------------------------------------------------
    def _conversation(self, conversation_id: str, cache_salt: str) -> Conversation:
        conv = self.conversations.get(conversation_key(conversation_id, cache_salt))
        if conv is None:
            raise ConversationNotFoundError(f"no conversation {conversation_id!r} under this cache_salt")
        return conv

    def rewind(self, conversation_id: str, cache_salt: str, turn: int) -> None:
        """Forget turns after `turn`; the head of `turn` is used if it is still retained."""
        conv = self._conversation(conversation_id, cache_salt)
        self._check_idle_turn(conv, turn)
        for head in [h for h in self.heads.of_conversation(conv.key) if h.turn > turn]:
            self.heads.drop(head)
        conv.truncate(turn)

    def fork(self, conversation_id: str, cache_salt: str, turn: int, new_conversation_id: str) -> None:
        """A new conversation whose history is turns 1..turn; KV blocks are shared by reference."""
        conv = self._conversation(conversation_id, cache_salt)
        self._check_idle_turn(conv, turn)
        new_key = conversation_key(new_conversation_id, cache_salt)
        if new_key in self.conversations:
            raise InvalidRequestError(f"conversation {new_conversation_id!r} already exists")
        fork = Conversation(new_key, new_conversation_id, conv.tokens_until(turn), [])
        for t in conv.turns[:turn]:
            fork.turns.append(type(t)(t.number, list(t.messages), t.start, t.end))
        self.conversations[new_key] = fork
        source = self.heads.get(conv.key, turn)
        if source is None:
            return
        holder = Holder.head(f"{new_key}#{turn}#{next(self._head_ids)}")
        self.kv.share(holder, self.kv.table(source.holder))
        copies = [(src, self.states.allocate(holder)) for src in self.states.slots[source.holder]]
        self.engine.runner.copy_slots(copies)
        self.heads.add(CommittedHead(holder, new_key, turn, source.state_len, source.aligned_len))

    def delete(self, conversation_id: str, cache_salt: str) -> None:
        conv = self._conversation(conversation_id, cache_salt)
        if conv.in_flight is not None:
            raise ConversationBusyError(f"conversation {conversation_id!r} has a turn in flight")
        for head in self.heads.of_conversation(conv.key):
            self.heads.drop(head)
        del self.conversations[conv.key]

    def _check_idle_turn(self, conv: Conversation, turn: int) -> None:
        if conv.in_flight is not None:
            raise ConversationBusyError(f"conversation {conv.conversation_id!r} has a turn in flight")
        if not 0 <= turn <= conv.turn:
            raise ConversationNotFoundError(f"conversation {conv.conversation_id!r} has no turn {turn}")

    def describe(self, conversation_id: str, cache_salt: str) -> dict[str, Any]:
        conv = self._conversation(conversation_id, cache_salt)
        return {
            "conversation_id": conv.conversation_id,
            "turn": conv.turn,
            "committed_tokens": len(conv.token_ids),
            "tokens_digest": tokens_digest(conv.token_ids),
            "messages": conv.messages,
            "token_ids": list(conv.token_ids),
            "retained_turns": sorted(h.turn for h in self.heads.of_conversation(conv.key)),
        }

    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            "evictions": self.heads.evictions,
            "cow_block_copies": self.engine.caches.counters["cow_block_copies"],
            "state_copies": self.engine.caches.counters["state_copies"],
            "heads": len(self.heads),
            "head_bytes": self.heads.bytes_used(),
            "head_budget_bytes": self.heads.budget_bytes,
        }
