"""The prefix index from the app's side: which replicas to prefer for a request's messages
(ingress), and what a worker announces it holds after a turn (worker).

    ingress:  message_prefix_digests(salt, messages) -> FindPrefix (one attempt, PREFIX_LOOKUP_S)
              -> TurnJob.prefix_holders -> the router ranks them first (router.py)
    worker:   final RequestOutput.checkpoints [(k, tokens)] -> names of messages[:k] (k past the
              messages: + the reply) -> AnnouncePrefixes, awaited at most ANNOUNCE_WAIT_S before
              the answer ends (the next request of an agent loop follows at once)

Both are hints: a lookup that fails or is slow routes by load, an announce that fails is logged
and counted; neither fails or holds up a turn. The worker reuses a prefix only where the token
ids match exactly, so a stale entry costs a recompute, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc

from cache_service.client import SERVICE_LIMITS, CacheClient, CacheError
from proto.contract import message_prefix_digests

log = logging.getLogger("hybridserve.prefix_index")

# The longest a request waits for its routing hint. The index answers in one Redis round trip
# (about a millisecond); past this, the cache service is in trouble and the request goes to the
# least loaded replica instead.
PREFIX_LOOKUP_S = 0.1
# A failing lookup or announce is counted every time, logged at most this often.
WARN_EVERY_S = 60.0
# Announces a worker has in flight at most; more are dropped (and counted as failed): while the
# cache service is down each one retries for a while, and they must not pile up.
MAX_ANNOUNCES_IN_FLIGHT = 64
# How long a worker holds a stateless request's (or first turn's) end for its announce to land.
ANNOUNCE_WAIT_S = 0.05


class FailureLog:
    """Counts failures; one warning per WARN_EVERY_S says how many there were (an outage of the
    cache service would otherwise log once per request)."""

    def __init__(self, what: str):
        self.what = what
        self.count = 0
        self._warned_at = float("-inf")
        self._unreported = 0

    def failed(self, error: BaseException) -> None:
        self.count += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning("%s failed %d time(s) (total %d), latest: %s: %s", self.what, self._unreported,
                        self.count, type(error).__name__, error)
            self._warned_at, self._unreported = now, 0


LOOKUP_FAILURES = FailureLog("prefix lookup")
_HINT_ERRORS = (CacheError, grpc.RpcError, TimeoutError, OSError)


async def find_holders(cache: CacheClient, scope: str, messages: Sequence[dict], *,
                       timeout_s: float = PREFIX_LOOKUP_S) -> tuple[tuple[str, int], ...]:
    """(replica, tokens held) of every replica holding a prefix of `messages` in `scope` (the
    request's cache salt), each with its longest; () when none does or the lookup failed."""
    # The index bounds one lookup; the longest prefixes are the ones worth finding.
    names = message_prefix_digests(scope, list(messages))[-SERVICE_LIMITS.max_prefix_names:]
    try:
        match = await cache.find_prefix(names, timeout_s=timeout_s)
    except _HINT_ERRORS as e:
        LOOKUP_FAILURES.failed(e)
        return ()
    return () if match is None else match.holders


def announcement(scope: str, messages: Sequence[dict], reply: dict,
                 checkpoints: Sequence[tuple[int, int]]) -> list[tuple[str, int]]:
    """(prefix name, tokens) per engine checkpoint (k messages covered, tokens): k names
    messages[:k]; k == len(messages) + 1 the messages plus the reply (the assistant message as
    the client will send it back: its content, and its tool calls if it made any)."""
    if not checkpoints:
        return []
    chat = [*messages, reply]
    names = message_prefix_digests(scope, chat)
    return [(names[k - 1], tokens) for k, tokens in checkpoints if 1 <= k <= len(chat) and tokens > 0]


class Announcer:
    """A worker's announces, each in a task of its own (`spawn`): the turn never waits for one."""

    def __init__(self, replica: str, cache: Callable[[], Awaitable[CacheClient]],
                 spawn: Callable[[Awaitable[None]], None]):
        self.replica, self._cache, self._spawn = replica, cache, spawn
        self.failures = FailureLog("prefix announce")
        self.announced = 0  # names announced (a name announced again counts again)
        self.in_flight = 0

    def after_turn(self, scope: str, messages: Sequence[dict], reply: dict,
                   checkpoints: Sequence[tuple[int, int]]) -> asyncio.Event:
        """Start the announce; the event is set once it is done (landed, failed or dropped)."""
        done = asyncio.Event()
        if not checkpoints:
            done.set()
            return done
        if self.in_flight >= MAX_ANNOUNCES_IN_FLIGHT:
            self.failures.failed(OverflowError(f"{self.in_flight} announces already in flight; dropped"))
            done.set()
            return done
        self.in_flight += 1
        self._spawn(self._announce(scope, list(messages), reply, tuple(checkpoints), done))
        return done

    async def after_turn_awaited(self, scope: str, messages: Sequence[dict], reply: dict,
                                 checkpoints: Sequence[tuple[int, int]], wait_s: float = ANNOUNCE_WAIT_S) -> None:
        """Announce, and wait up to `wait_s` for it to land: an agent loop's next request follows
        the answer at once, and its routing hint must already name this replica (one Redis round
        trip, about a millisecond; a slow service only delays the answer's end by `wait_s`)."""
        done = self.after_turn(scope, messages, reply, checkpoints)
        try:
            await asyncio.wait_for(done.wait(), wait_s)
        except TimeoutError:
            pass  # it lands later, or fails and is counted: a hint either way

    async def _announce(self, scope: str, messages: list[dict], reply: dict,
                        checkpoints: tuple[tuple[int, int], ...], done: asyncio.Event) -> None:
        try:
            entries = announcement(scope, messages, reply, checkpoints)
            if entries:
                await (await self._cache()).announce_prefixes(self.replica, entries)
                self.announced += len(entries)
        except _HINT_ERRORS as e:
            self.failures.failed(e)
        finally:
            self.in_flight -= 1
            done.set()
