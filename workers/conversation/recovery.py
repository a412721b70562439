"""The recovery ladder's engine side: adopt the service's ledger, rebuild a head from it.

The cache service's ledger is the record; the engine's is a cache of it keyed by version.
`adopt_ledger` installs a ledger read from the service; heads whose committed prefix it
still contains stay valid (a head's state is a function of its tokens alone).
`materialize_head` runs the committed tokens as a prefill-only request (no sampling): its
state covers all but the last committed token, exactly what a turn leaves behind, so the
next turn continues it as if nothing had been lost.

Which path builds it is the caller's choice: `canonical=True` runs the tokens in tiles
(bit-identical to a head deterministic turns built), the default one fast prefill (equal to
float rounding, see ARCHITECTURE.md). The engine's one rule makes either safe: a
deterministic turn never continues a head the fast path made, it drops it and recomputes its
prompt in tiles. That is also how the worker deployment recovers from the ledger: it adopts
the ledger and starts the next turn without materializing, so that turn's whole prompt runs
in tiles when it is deterministic and in one fast prefill otherwise.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from proto.contract import ConversationRef
from workers.cache.heads import CommittedHead
from workers.conversation.ledger import ConversationLedger, find_conversation
from workers.conversation.records import LedgerTurn
from workers.conversation.retention import HeadRetention
from workers.engine import LLMEngine
from workers.errors import ConversationNotFoundError, InvalidRequestError
from workers.request import KeepState, Request
from workers.sampling import SamplingParams

_PREFILL = SamplingParams(max_tokens=1, temperature=0.0)
_CANONICAL_PREFILL = SamplingParams(max_tokens=1, temperature=0.0, deterministic=True)


@dataclass(frozen=True)
class Materializing:
    """A rebuild in flight: the head it becomes and the head it may replace."""

    key: str
    turn: int
    version: int
    replacing: CommittedHead | None  # the fast-path head a canonical rebuild supersedes


def _validated(vocab: int, turns: Sequence[LedgerTurn]) -> list[LedgerTurn]:
    for i, turn in enumerate(turns, 1):
        ids = turn.token_ids
        if not ids or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
            raise InvalidRequestError(f"ledger turn {i}: token ids must be a non-empty list of integers")
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"ledger turn {i}: token ids out of range [0, {vocab})")
        if not all(isinstance(m, dict) for m in turn.messages):
            raise InvalidRequestError(f"ledger turn {i}: messages must be objects")
    return list(turns)


class LedgerRecovery:
    """Adopting the service's ledger and rebuilding heads from it, over the engine's ledgers."""

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
        self.materializing: dict[str, Materializing] = {}  # by request id

    def adopt_ledger(self, ref: ConversationRef, version: int, turns: Sequence[LedgerTurn]) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidRequestError(f"version must be an integer >= 0, got {version!r}")
        key = ref.key
        old = self.conversations.get(key)
        if old is not None:
            old.ensure_idle()
        new = ConversationLedger(ref, version=version)
        for turn in _validated(self.engine.model_config.vocab_size, turns):
            new.append([dict(m) for m in turn.messages], list(turn.token_ids))
        if old is not None and (old.version, old.token_ids, old.messages) == (version, new.token_ids, new.messages):
            return  # the engine already caches this version
        for head in self.heads.of_conversation(key):
            same_prefix = old is not None and head.turn <= new.turn
            if not (same_prefix and old.tokens_until(head.turn) == new.tokens_until(head.turn)):
                self.heads.drop(head)
            else:
                head.version = version
        if new.turn == 0:
            self.conversations.pop(key, None)
        else:
            self.conversations[key] = new

    def materialize_head(
        self, ref: ConversationRef, request_id: str, canonical: bool = False
    ) -> Request | None:
        """Start a prefill-only request building the latest turn's head; None if a head that
        serves is held already (any head; with `canonical`, one the tiles made)."""
        conv = find_conversation(self.conversations, ref)
        conv.ensure_idle()
        if conv.turn == 0:
            raise ConversationNotFoundError(f"conversation {ref.id!r} has no committed turn")
        held = self.heads.find(conv.key, conv.turn)
        if held is not None and (not canonical or held.canonical_window == self.engine.config.deterministic.window):
            return None
        if len(conv.token_ids) < 2:
            raise InvalidRequestError("a head needs at least two committed tokens")
        # The last committed token was sampled, never fed: the next turn runs it first.
        # Canonical: the prompt runs in deterministic tiles on the absolute grid, so the head has
        # the bits any deterministic turn would have left, however that turn was batched.
        request = self.engine.add_request(
            request_id,
            conv.token_ids[:-1],
            _CANONICAL_PREFILL if canonical else _PREFILL,
            keep=KeepState.PREPARE,
            on_finished=self._materialized,
            prefill_only=True,
            prefix_scope=conv.ref.salt,  # the rebuilt head is named by its tokens like any other
        )
        conv.in_flight = request_id
        # Only the head seen here may be replaced (None unless a canonical rebuild supersedes a
        # fast-path head): one that appears meanwhile is never overwritten.
        self.materializing[request_id] = Materializing(conv.key, conv.turn, conv.version, held)
        return request

    def _materialized(self, request: Request) -> None:
        job = self.materializing.pop(request.request_id)
        conv = self.conversations[job.key]
        conv.in_flight = None
        if request.prepared is None:
            return  # aborted or failed: nothing was kept
        # `replacing` is dropped only once the state has moved; any other head of the turn makes
        # commit refuse, and the engine then fails this request alone and frees its state.
        self.heads.commit(request.prepared, job.key, job.turn, job.version, replacing=job.replacing)
        self.counters["materialized"] += 1
        self.retention.retire_older(job.key, job.turn)
