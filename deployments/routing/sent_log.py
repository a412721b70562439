"""What this router sent each replica that the replica's last report cannot count yet.

A replica reports its queue every period (`Worker.record_routing_stats`, stamped `reported_at`)
and Serve delivers the report later still: seconds, on a loaded host. Every request sent after
the report is in no report. The router adds those itself, each at its own estimated prefill
(what it computes there: its prompt less what that replica holds or is computing of it):

    choose_replicas(X)  ─ choice X -> A, ~2,100 tokens ─┐   counted from the choice on
    on_send_request(A)  ─ sent(A, now, ~2,100)  <───────┘   (Serve sent it: the oldest choice of A)
    A's report at t_r:  its waiting tokens (of the reported requests still live)
                        + the estimates of what was sent to A after t_r (at most as many as live)
                        + the estimates of the choices of A not sent yet

Before, a replica's requests sent since its report were each priced at the replica's mean
prefill, and they were counted only beyond the report's request count. A report that was stale
(its requests had ended) hid that many new sends, and a replica with long past prompts looked
busier by its history: bench.agent saw 7 of 8 loops started together go to one replica of two.

Bounded: a replica's sends older than its last report are dropped at each pricing, and at most
SENT_KEPT per replica are kept (the oldest go first) however rarely it reports.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# A choice no request was sent for (cancelled while probing, or sent to a later rank) stops
# counting after this.
CHOICE_TTL_S = 2.0
# Sends remembered per replica at most: the queue of one report period, however long that is.
SENT_KEPT = 4096


@dataclass(frozen=True)
class _Choice:
    replica: Hashable
    at: float  # monotonic
    tokens: float | None  # estimated prefill there; None: unknown (priced at the replica's mean)


class SentLog:
    def __init__(self, clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic):
        self._clock = clock  # the replicas' `reported_at` clock (wall time)
        self._monotonic = monotonic
        self._choices: dict[str, _Choice] = {}  # internal request id -> its first rank, not sent yet
        self._sent: dict[Hashable, deque[tuple[float, float | None]]] = {}  # replica -> (sent at, tokens)

    def choose(self, request_id: str, replica: Hashable, tokens: float | None) -> None:
        self._choices[request_id] = _Choice(replica, self._monotonic(), tokens)

    def forget_choice(self, request_id: str) -> None:
        """A retry chooses again."""
        self._choices.pop(request_id, None)

    def on_send(self, replica: Hashable) -> None:
        """Serve sent a request to `replica`: the oldest choice of it becomes a send. A send with
        no choice (a request routed before this router knew it) counts at an unknown size."""
        mine = [(c.at, rid) for rid, c in self._choices.items() if c.replica == replica]
        tokens = self._choices.pop(min(mine)[1]).tokens if mine else None
        self._sent.setdefault(replica, deque(maxlen=SENT_KEPT)).append((self._clock(), tokens))

    def unsent(self) -> Counter:
        """Choices not sent yet, by replica (expired ones dropped)."""
        expired = self._monotonic() - CHOICE_TTL_S
        for rid in [rid for rid, c in self._choices.items() if c.at < expired]:
            del self._choices[rid]
        return Counter(c.replica for c in self._choices.values())

    def since(self, replica: Hashable, reported_at: float) -> list[float | None]:
        """Estimated prefill of each request sent to `replica` after its report, oldest first,
        then of its choices not sent yet. Sends the report covers are dropped."""
        sent = self._sent.get(replica)
        if sent is not None:
            while sent and sent[0][0] <= reported_at:
                sent.popleft()
            if not sent:
                del self._sent[replica]
        out = [tokens for _, tokens in sent or ()]
        return out + [c.tokens for c in sorted(self._choices.values(), key=lambda c: c.at) if c.replica == replica]

    def forget_replicas(self, live: set) -> None:
        """Drop the sends of replicas that are gone."""
        for replica in [r for r in self._sent if r not in live]:
            del self._sent[replica]
