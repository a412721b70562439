"""The cache client's calls to the prefix index (a mixin of CacheClient, client.py): which
replica, or the state tier, holds the state of which message prefix.

Every prefix call names the scope its names were made in (message_prefix_digests' first
argument): the service keeps one scope's names together, on one Redis Cluster slot. None: no
scope (the index's common slot, as before scopes existed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache_service.client_config import SERVICE_LIMITS
from cache_service.client_transport import Transport
from proto import cache_pb2 as pb
from proto.contract import TIER_HOLDER, prefix_scope_tag


def scope_tag(scope: str | None) -> str:
    return "" if scope is None else prefix_scope_tag(scope)


@dataclass(frozen=True)
class PrefixMatch:
    """Who holds a chat's prefixes: `index` into the names asked for (entry k names
    messages[:k + 1]) of the longest any replica holds, and every holder as (replica, tokens of
    its longest)."""

    index: int
    holders: tuple[tuple[str, int], ...]
    # The state tier's longest of them (proto.contract.TIER_HOLDER in the index), as (name, tokens):
    # not a replica, so not among `holders`; any replica can import it.
    tier: tuple[str, int] | None = None


class PrefixIndexCalls:
    _calls: Transport

    async def announce_prefixes(self, replica: str, entries: Sequence[tuple[str, int]],
                                *, scope: str | None = None) -> None:
        """Record that `replica` holds the state of each (prefix name, tokens); more than one
        request's worth (SERVICE_LIMITS.max_prefix_entries) is sent in several."""
        step, tag = SERVICE_LIMITS.max_prefix_entries, scope_tag(scope)
        for start in range(0, len(entries), step):
            await self._calls.unary("AnnouncePrefixes", pb.AnnouncePrefixesRequest(replica=replica, scope=tag, entries=[
                pb.PrefixEntry(name=name, tokens=tokens) for name, tokens in entries[start:start + step]]))

    async def forget_prefixes(self, replica: str, names: Sequence[str], *, scope: str | None = None) -> None:
        """`replica` no longer holds these prefixes (names it never announced are fine)."""
        step, tag = SERVICE_LIMITS.max_prefix_entries, scope_tag(scope)
        for start in range(0, len(names), step):
            await self._calls.unary("ForgetPrefixes", pb.ForgetPrefixesRequest(
                replica=replica, scope=tag, names=list(names[start:start + step])))

    async def find_prefix(self, names: Sequence[str], *, scope: str | None = None,
                          timeout_s: float | None = None) -> PrefixMatch | None:
        """The longest prefix among `names` (a chat's message_prefix_digests) that a replica
        holds, None if none does. With `timeout_s` the call is one attempt within that deadline
        (a routing hint must not wait for retries); without, as every call."""
        if not names:
            return None
        request = pb.FindPrefixRequest(names=list(names), scope=scope_tag(scope))
        if timeout_s is None:
            reply = await self._calls.unary("FindPrefix", request)
        else:
            reply = await self._calls.once("FindPrefix", request, timeout_s)
        if reply.index < 0:
            return None
        tier = next(((names[h.index], h.tokens) for h in reply.holders
                     if h.replica == TIER_HOLDER and 0 <= h.index < len(names)), None)
        replicas = tuple((h.replica, h.tokens) for h in reply.holders if h.replica != TIER_HOLDER)
        return PrefixMatch(reply.index, replicas, tier)
