"""History operations on an idle conversation: rewind, fork, delete, describe.

Each changes the engine's ledger and its heads together; the worker maps them onto the cache
service's RPCs (RewindConversation, ForkConversation, DeleteConversation), whose ledger is
the record.
"""

from __future__ import annotations

from typing import Any

from proto.contract import tokens_digest
from workers.cache.coordinator import CacheCoordinator
from workers.cache.heads import HeadManager
from workers.conversation.ledger import ConversationLedger
from workers.conversation.records import LedgerTurn
from workers.errors import ConversationNotFoundError, InvalidRequestError


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
