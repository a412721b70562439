"""What the conversation cache keeps about a turn between its start and its resolution.

    begin_turn ──> PendingTurn     base turn and version, suffix, start offset, commit mode
    finish     ──> PreparedTurn    the TurnCommit record + the prepared state it describes
    commit / abandon / expiry ──> two_phase.py's rules (a resolution is remembered)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proto.contract import tokens_digest
from workers.cache.heads import CommittedHead, PreparedState
from workers.conversation.ledger import ConversationLedger
from workers.conversation.records import CommitMode, TurnCommit
from workers.engine import LLMEngine
from workers.request import FinishReason, Request


@dataclass(frozen=True)
class PendingTurn:
    key: str
    base_turn: int
    base_version: int
    suffix: tuple[dict[str, Any], ...]
    start: int
    mode: CommitMode
    replacing: CommittedHead | None  # the head of base_turn + 1 when the turn began (regenerate)


@dataclass(frozen=True)
class PreparedTurn:
    record: TurnCommit
    state: PreparedState
    tokens_reused: int
    replacing: CommittedHead | None


def turn_record(engine: LLMEngine, conv: ConversationLedger, pending: PendingTurn, request: Request) -> TurnCommit:
    """The record of a turn whose request completed with a prepared state."""
    output = request.output_token_ids
    if request.finish_reason is FinishReason.STOP and output and output[-1] in engine.eos_token_ids:
        output = output[:-1]  # the template writes the end-of-turn token itself
    # Special tokens inside the reply stay: the content must render back to what the model saw.
    reply = {"role": "assistant", "content": engine.tokenizer.decode_exact(output)}
    committed = request.token_ids
    return TurnCommit(
        request_id=request.request_id,
        conversation=conv.ref,
        base_version=pending.base_version,
        base_turn=pending.base_turn,
        start=pending.start,
        token_ids=tuple(committed[pending.start :]),
        messages=(*pending.suffix, reply),
        committed_tokens=len(committed),
        tokens_digest=tokens_digest(committed),
        state_len=request.prepared.state_len,
        finish_reason=request.finish_reason,
    )
