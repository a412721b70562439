"""What the ledger says of a turn: the answer when a publish's outcome is unknown, and the
answer to an idempotent retry.

A turn's publish names itself (`TurnJob.publish_name`). When the ingress cannot tell from the
worker whether the publish landed (the replica was lost, the service was unreachable, the
lease was lost mid-turn), it first *fences* the turn — discards the lease, so nothing can
publish under it any more — and then reads the ledger: the turn committed exactly when a
ledger entry after the turn's base carries its name. The client is then told what the ledger
holds: the committed answer (from the entry's `result`), or that nothing was committed.

An idempotent turn's name is `idem-<key digest>-<request digest>`: a retry with the same
Idempotency-Key finds it among the conversation's latest turns and is answered from the
ledger; the same key with another body is refused (422).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from cache_service.client import CacheClient, NotFound, pb
from deployments.messages import Recovery, ToolCall, ToolCallDelta, TurnDelta, TurnDone, TurnEvent
from deployments.tool_replies import call_id
from workers.tools.formats import format_named
from proto.contract import ConversationRef

# A retry is matched against this many of the conversation's latest turns: a client retries
# the turn it just sent, not one from many turns ago.
IDEMPOTENCY_WINDOW_TURNS = 16


@dataclass(frozen=True)
class IdempotencyKey:
    """The client's Idempotency-Key and the digest of the request it came with."""

    key_digest: str
    request_digest: str

    @classmethod
    def of(cls, key: str, request: dict) -> "IdempotencyKey":
        canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return cls(_digest(key.encode()), _digest(canonical.encode("utf-8", "surrogatepass")))

    @property
    def publish_id(self) -> str:
        return f"idem-{self.key_digest}-{self.request_digest}"

    def same_key(self, publish_id: str) -> bool:
        return publish_id.startswith(f"idem-{self.key_digest}-")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


async def find_turn(cache: CacheClient, conv: ConversationRef, *, after_turn: int,
                    match: Callable[[str], bool]) -> pb.LedgerTurn | None:
    """The latest ledger turn after `after_turn` whose publish id matches, if any."""
    try:
        ledger = await cache.read_ledger(conv, from_turn=after_turn + 1)
    except NotFound:  # nothing committed yet (or deleted meanwhile)
        return None
    for turn in reversed(ledger.turns):
        if match(turn.publish_id):
            return turn
    return None


@dataclass
class Streamed:
    """What a turn's client has been sent so far: a replay of the turn sends only the rest."""

    text: str = ""
    call_arguments: dict[int, int] = field(default_factory=dict)  # call index -> argument chars sent
    deltas: int = 0

    def add(self, delta: TurnDelta) -> None:
        self.text += delta.text
        self.deltas += 1
        for piece in delta.tool_calls:
            self.call_arguments[piece.index] = self.call_arguments.get(piece.index, 0) + len(piece.arguments)


def sent_reply(turn: pb.LedgerTurn) -> tuple[str, tuple[ToolCall, ...]]:
    """The reply's content and tool calls as the turn's live answer sent them.

    The ledger's last message is the model's side (every generated token decoded: a matched
    stop string, the text after it in the last token, special tokens), which the next turn's
    prompt re-renders; the client was sent `result.sent`. A turn published before `sent`
    existed is read from its message (the calls parsed back out of its text)."""
    result = turn.result
    if result.HasField("sent"):
        return result.sent.content, tuple(ToolCall(c.id, c.name, c.arguments) for c in result.sent.tool_calls)
    reply = next((m.content for m in reversed(turn.messages) if m.role == "assistant"), "")
    if not result.tool_format:
        return reply, ()
    reply, parsed = format_named(result.tool_format).parse(reply)
    return reply, tuple(ToolCall(call_id(turn.publish_id, i), c.name, c.arguments) for i, c in enumerate(parsed))


def replay(turn: pb.LedgerTurn, streamed: Streamed | None = None) -> list[TurnEvent]:
    """The events of a committed turn, read back from its ledger entry: the reply's text and
    tool calls (what the client has not been sent yet of them) and its result."""
    streamed = streamed or Streamed()
    reply, calls = sent_reply(turn)
    result = turn.result
    rest = reply[len(streamed.text):] if reply.startswith(streamed.text) else reply
    done = TurnDone(result.finish_reason or "stop", result.prompt_tokens, result.completion_tokens,
                    result.cached_tokens, Recovery.REPLAY, replica="", turn=turn.turn, tool_calls=calls)
    deltas = []
    for i, call in enumerate(calls):
        sent = streamed.call_arguments.get(i)
        if sent is None:
            deltas.append(ToolCallDelta(i, call.id, call.name, call.arguments))
        elif len(call.arguments) > sent:
            deltas.append(ToolCallDelta(i, arguments=call.arguments[sent:]))
    return ([TurnDelta(rest, (), None, tuple(deltas))] if rest or deltas else []) + [done]
