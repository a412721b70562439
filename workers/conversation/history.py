"""History operations on an idle conversation: rewind, fork, delete, describe.

Each changes the engine's ledger and its heads together; the worker maps them onto the cache
service's RPCs (RewindConversation, ForkConversation, DeleteConversation), whose ledger is
the record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proto.contract import conversation_key, tokens_digest
from workers.conversation.ledger import Conversation
from workers.conversation.records import LedgerTurn
from workers.errors import ConversationNotFoundError, InvalidRequestError

if TYPE_CHECKING:
    from workers.conversation.cache import ConversationCache


def check_idle_turn(conv: Conversation, turn: int) -> None:
    conv.ensure_idle()
    if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn <= conv.turn:
        raise ConversationNotFoundError(f"conversation {conv.conversation_id!r} has no turn {turn!r}")


def rewind(cc: ConversationCache, conversation_id: str, cache_salt: str, turn: int) -> None:
    conv = cc.conversation_of(conversation_id, cache_salt)
    check_idle_turn(conv, turn)
    for head in [h for h in cc.heads.of_conversation(conv.key) if h.turn > turn]:
        cc.heads.drop(head)
    if turn < conv.turn:
        conv.truncate(turn)
        conv.version += 1


def fork(cc: ConversationCache, conversation_id: str, cache_salt: str, turn: int, new_conversation_id: str) -> None:
    conv = cc.conversation_of(conversation_id, cache_salt)
    check_idle_turn(conv, turn)
    new_key = conversation_key(new_conversation_id, cache_salt)
    if new_key in cc.conversations:
        raise InvalidRequestError(f"conversation {new_conversation_id!r} already exists")
    forked = Conversation(new_key, new_conversation_id, version=turn)
    for t in conv.turns[:turn]:
        forked.append([dict(m) for m in t.messages], conv.token_ids[t.start : t.end])
    source = cc.heads.find(conv.key, turn)
    if source is not None:
        cc.caches.fork_head(source, new_key, turn, forked.version)  # all-or-nothing
    cc.conversations[new_key] = forked


def delete(cc: ConversationCache, conversation_id: str, cache_salt: str) -> None:
    conv = cc.conversation_of(conversation_id, cache_salt)
    conv.ensure_idle()
    for head in cc.heads.of_conversation(conv.key):
        cc.heads.drop(head)
    del cc.conversations[conv.key]


def describe(cc: ConversationCache, conversation_id: str, cache_salt: str) -> dict[str, Any]:
    conv = cc.conversation_of(conversation_id, cache_salt)
    return {
        "conversation_id": conv.conversation_id,
        "turn": conv.turn,
        "version": conv.version,
        "committed_tokens": len(conv.token_ids),
        "tokens_digest": tokens_digest(conv.token_ids),
        "messages": conv.messages,
        "token_ids": list(conv.token_ids),
        "ledger": [LedgerTurn(tuple(t.messages), tuple(conv.token_ids[t.start : t.end])) for t in conv.turns],
        "retained_turns": sorted(h.turn for h in cc.heads.of_conversation(conv.key)),
    }
