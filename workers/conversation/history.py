"""History operations on an idle conversation: rewind, fork, delete, describe (and cutting a
head back to its block-aligned state, what a block-aligned cache would have kept).

Each changes the engine's ledger and its heads together; the worker maps them onto the cache
service's RPCs (RewindConversation, ForkConversation, DeleteConversation), whose ledger is
the record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proto.contract import tokens_digest
from workers.cache.coordinator import CacheCoordinator
from workers.cache.heads import HeadManager
from workers.conversation.ledger import ConversationLedger
from workers.conversation.records import LedgerTurn
from workers.errors import ConversationNotFoundError, InvalidRequestError

if TYPE_CHECKING:
    from workers.engine import LLMEngine


def check_idle_turn(conv: ConversationLedger, turn: int) -> None:
    conv.ensure_idle()
    if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn <= conv.turn:
        raise ConversationNotFoundError(f"conversation {conv.ref.id!r} has no turn {turn!r}")


def rewind(heads: HeadManager, conv: ConversationLedger, turn: int) -> None:
    check_idle_turn(conv, turn)
    for head in [h for h in heads.of_conversation(conv.key) if h.turn > turn]:
        heads.drop(head)
    if turn < conv.turn:
        conv.truncate(turn)
        conv.version += 1


def fork(
    caches: CacheCoordinator,
    conversations: dict[str, ConversationLedger],
    conv: ConversationLedger,
    turn: int,
    new_conversation_id: str,
) -> None:
    check_idle_turn(conv, turn)
    new = conv.ref.fork(new_conversation_id)
    if new.key in conversations:
        raise InvalidRequestError(f"conversation {new.id!r} already exists")
    forked = ConversationLedger(new, version=turn)
    for t in conv.turns[:turn]:
        forked.append([dict(m) for m in t.messages], conv.token_ids[t.start : t.end])
    source = caches.heads.find(conv.key, turn)
    if source is not None:
        caches.fork_head(source, new.key, turn, forked.version)  # all-or-nothing
    conversations[new.key] = forked


def delete(heads: HeadManager, conversations: dict[str, ConversationLedger], conv: ConversationLedger) -> None:
    conv.ensure_idle()
    for head in heads.of_conversation(conv.key):
        heads.drop(head)
    del conversations[conv.key]


def describe(heads: HeadManager, conv: ConversationLedger) -> dict[str, Any]:
    return {
        "conversation_id": conv.ref.id,
        "turn": conv.turn,
        "version": conv.version,
        "committed_tokens": len(conv.token_ids),
        "tokens_digest": tokens_digest(conv.token_ids),
        "messages": conv.messages,
        "token_ids": list(conv.token_ids),
        "ledger": [LedgerTurn(tuple(t.messages), tuple(conv.token_ids[t.start : t.end])) for t in conv.turns],
        "retained_turns": sorted(h.turn for h in heads.of_conversation(conv.key)),
    }


def cut_to_aligned(engine: LLMEngine, conv: ConversationLedger, turn: int) -> tuple[int, int]:
    """Make the head of `turn` what a block-aligned cache keeps (vLLM's reuse on hybrids holds
    Mamba state only at block boundaries): KV up to its last full block and the Mamba state of
    that boundary, copied into the head's terminal slot. The next turn then recomputes
    [aligned, committed) before its suffix. Returns (committed, aligned) lengths.

        committed head:  [ block 0 | block 1 | tail.. ]    state at `committed`
        after the cut:   [ block 0 | block 1 ]             state at `aligned` (the snapshot)
    """
    check_idle_turn(conv, turn)
    caches = engine.caches
    head = caches.heads.find(conv.key, turn, touch=False)
    if head is None:
        raise ConversationNotFoundError(f"conversation {conv.ref.id!r} holds no head of turn {turn}")
    committed, aligned = head.state_len, head.aligned_len
    terminal, snapshot = caches.states.slots[head.holder]
    if aligned != committed:
        engine.runner.copy_slots([(snapshot, terminal)])
    caches.kv.truncate(head.holder, aligned)
    caches.heads.unname(head)  # it no longer covers the tokens it was named by
    head.state_len = aligned
    return committed, aligned
