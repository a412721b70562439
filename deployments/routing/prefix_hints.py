"""The prefix index from the app's side: which replicas to prefer for a request's messages
(ingress), and what a worker announces it holds after a turn (worker).

    ingress:  message_prefix_digests(salt, messages) -> FindPrefix (one attempt, PREFIX_LOOKUP_S)
              -> TurnJob.prefix_holders -> the router ranks them first (router.py)
    worker:   final RequestOutput.checkpoints [(k, tokens)] -> names of messages[:k] (k past the
              messages: + the reply) -> AnnouncePrefixes, in a task of its own; the same names
              go back to the ingress in TurnDone.prefixes (recent_prefixes.py), so the next
              request of an agent loop, which follows at once, finds them whenever it is looked up
              engine evicts a checkpoint -> its `withdrawn_prefixes` -> ForgetPrefixes of the
              names it was announced under (after each turn), so the index names what is held

Both are hints: a lookup that fails or is slow routes by load, an announce that fails is logged
and counted; neither fails or holds up a turn. The worker reuses a prefix only where the token
ids match exactly, so a stale entry costs a recompute, never a wrong answer.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass

import grpc

from cache_service.client import SERVICE_LIMITS, CacheClient, CacheError
from deployments.routing.recent_prefixes import RECENT, merged
from deployments.settings import AppSettings, TierExport
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
# Engine checkpoint names a worker remembers the announces of (far more than its prefix budget
# holds checkpoints of a small model; the oldest are the likeliest evicted already).
NAMES_KEPT = 16384


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


@dataclass(frozen=True)
class PrefixHints:
    """Where a request's message prefixes are held: `holders` (replica, tokens of its longest),
    `tier`, (name, tokens) of the longest the state tier holds (None: none), and `longest`, (k,
    tokens): the longest any replica holds is messages[:k], that many tokens as its engine counted
    them (what token_estimate.py calibrates its estimates by)."""

    holders: tuple[tuple[str, int], ...] = ()
    tier: tuple[str, int] | None = None
    longest: tuple[int, int] | None = None


async def find_holders(cache: CacheClient, scope: str, messages: Sequence[dict], *,
                       timeout_s: float = PREFIX_LOOKUP_S) -> PrefixHints:
    """Every replica holding a prefix of `messages` in `scope` (the request's cache salt), each
    with its longest, and the tier's longest; nothing when none does or the lookup failed. The
    index's answer is completed by what this ingress just saw replicas leave (recent_prefixes.py:
    an announce may land after an agent loop's next lookup)."""
    # The index bounds one lookup; the longest prefixes are the ones worth finding.
    every = message_prefix_digests(scope, list(messages))
    names = every[-SERVICE_LIMITS.max_prefix_names:]
    recent = RECENT.holders(names)
    try:
        match = await cache.find_prefix(names, scope=scope, timeout_s=timeout_s)
    except _HINT_ERRORS as e:
        LOOKUP_FAILURES.failed(e)
        return PrefixHints(merged((), recent))
    if match is None:
        return PrefixHints(merged((), recent))
    longest = None
    if match.holders:  # the holders' longest is names[match.index]
        longest = (len(every) - len(names) + match.index + 1, max(tokens for _, tokens in match.holders))
    return PrefixHints(merged(match.holders, recent), match.tier, longest)


def tier_import_applies(settings: AppSettings, prompt: object, sampling: dict) -> bool:
    """Whether a worker may import a stateless request's prefix from the state tier, so the router
    should price that (worker/prefix_tier.py): a chat (a completion's `prompt` is imported by no
    one), not deterministic (it attaches nothing), with the tier in use and prefix checkpoints
    kept (either backend: each imports its own format's)."""
    return (prompt is None and not sampling.get("deterministic")
            and settings.tier_export is not TierExport.OFF and settings.prefix_cache_mb > 0)


def announcement(scope: str, messages: Sequence[dict], reply: dict,
                 checkpoints: Sequence[tuple[int, int]]) -> list[tuple[str, int]]:
    """(prefix name, tokens) per engine checkpoint (k messages covered, tokens): k names
    messages[:k]; k == len(messages) + 1 the messages plus the reply (the assistant message as
    the client will send it back: its content, and its tool calls if it made any)."""
    return [(name, tokens) for _, name, tokens in _named(scope, messages, reply, checkpoints)]


def keyed(scope: str, messages: Sequence[dict], reply: dict, checkpoints: Sequence[tuple[int, int]],
          keys: Sequence[Hashable]) -> list[tuple[str, int, Hashable]]:
    """(prefix name, tokens, engine name) of the checkpoints that name a prefix and have an
    engine name (RequestOutput.checkpoint_keys): what the worker may export to the tier."""
    return [(name, tokens, keys[i]) for i, name, tokens in _named(scope, messages, reply, checkpoints) if i < len(keys)]


def _named(scope: str, messages: Sequence[dict], reply: dict,
           checkpoints: Sequence[tuple[int, int]]) -> list[tuple[int, str, int]]:
    """(position in checkpoints, prefix name, tokens) of the checkpoints that name a prefix."""
    if not checkpoints:
        return []
    chat = [*messages, reply]
    names = message_prefix_digests(scope, chat)
    return [(i, names[k - 1], tokens) for i, (k, tokens) in enumerate(checkpoints) if 1 <= k <= len(chat) and tokens > 0]


class Announcer:
    """A worker's announces, each in a task of its own (`spawn`): the turn never waits for one;
    and their withdrawal once the engine no longer holds the checkpoint (`withdraw`).

    The engine names a checkpoint by its tokens (PrefixKey), the index by its messages: the
    announcer remembers which index names each engine name was announced under (the latest
    NAMES_KEPT; one forgotten leaves a hint that expires with the index's TTL)."""

    def __init__(self, replica: str, cache: Callable[[], Awaitable[CacheClient]],
                 spawn: Callable[[Awaitable[None]], None]):
        self.replica, self._cache, self._spawn = replica, cache, spawn
        self.failures = FailureLog("prefix announce")
        self.announced = 0  # names announced (a name announced again counts again)
        self.withdrawn = 0  # names withdrawn
        self.in_flight = 0
        # engine name -> (scope, index name) of each announce: a withdrawal names the scope too
        self._names: OrderedDict[Hashable, set[tuple[str, str]]] = OrderedDict()

    def after_turn(self, scope: str, messages: Sequence[dict], reply: dict,
                   checkpoints: Sequence[tuple[int, int]], keys: Sequence[Hashable] = ()) -> tuple[tuple[str, int], ...]:
        """Start the announce (never waited for) and return what it names: (prefix name, tokens).
        `keys`: the engine's names of the checkpoints, in their order (RequestOutput.checkpoint_keys)."""
        named = _named(scope, messages, reply, checkpoints)
        entries = tuple((name, tokens) for _, name, tokens in named)
        if not entries:
            return entries
        if self.in_flight >= MAX_ANNOUNCES_IN_FLIGHT:
            self.failures.failed(OverflowError(f"{self.in_flight} announces already in flight; dropped"))
            return entries
        self._remember(scope, tuple(keys), named)  # now: a withdrawal may follow before the announce lands
        self.in_flight += 1
        self._spawn(self._announce(scope, list(entries)))
        return entries

    def withdraw(self, keys: Sequence[Hashable]) -> None:
        """The engine no longer holds these checkpoints: their index names go (in a task)."""
        by_scope: dict[str, set[str]] = {}
        for key in keys:
            for scope, name in self._names.pop(key, ()):
                by_scope.setdefault(scope, set()).add(name)
        for scope, names in by_scope.items():  # one call per scope: each touches one slot of the index
            self._spawn(self._forget(scope, sorted(names)))

    async def _forget(self, scope: str, names: list[str]) -> None:
        try:
            await (await self._cache()).forget_prefixes(self.replica, names, scope=scope)
            self.withdrawn += len(names)
        except _HINT_ERRORS as e:
            self.failures.failed(e)

    def _remember(self, scope: str, keys: tuple[Hashable, ...], named: list[tuple[int, str, int]]) -> None:
        for i, name, _ in named:
            if i < len(keys):
                self._names.setdefault(keys[i], set()).add((scope, name))
                self._names.move_to_end(keys[i])
        while len(self._names) > NAMES_KEPT:
            self._names.popitem(last=False)

    async def _announce(self, scope: str, entries: list[tuple[str, int]]) -> None:
        try:
            await (await self._cache()).announce_prefixes(self.replica, entries, scope=scope)
            self.announced += len(entries)
        except _HINT_ERRORS as e:
            self.failures.failed(e)
        finally:
            self.in_flight -= 1
