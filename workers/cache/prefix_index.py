"""Content addresses of cached states: which held state covers exactly which token prefix.

A committed head or a prefix checkpoint that covers the tokens t[0:L) of a prompt under a
cache scope (the salt, API-key scoped) is named by `PrefixKey(scope, L, sha256(t[0:L]))`.
A request attaches the longest named state whose tokens equal a prefix of its own, exactly
(token ids, never text): the digest of a prefix is computed in one pass over the prompt, read
off at each length some state of the scope has.

    prompt    [ s s s s s s | u u u u | a a a a a | u u u ]
    index      scope: {6: {d6: [C1]}, 15: {d15: [C2]}}
    lookup     hash the prompt once; digest at 6 = d6 (hit), at 15 = d15 (hit) -> C2, 15 tokens

Another scope never matches: its keys live under another dict entry.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from typing import Generic, TypeVar

from proto.contract import token_bytes
from workers.state_names import PrefixKey

State = TypeVar("State")


def prefix_digests(token_ids: list[int], lengths: list[int]) -> Iterator[tuple[int, str]]:
    """(L, tokens_digest(token_ids[:L])) for each L in ascending `lengths`, in one pass."""
    raw = memoryview(token_bytes(token_ids))
    hasher, done = hashlib.sha256(), 0
    for length in lengths:
        hasher.update(raw[4 * done : 4 * length])
        done = length
        yield length, hasher.copy().hexdigest()


def prefix_keys(scope: str, token_ids: list[int], lengths: list[int]) -> list[PrefixKey]:
    return [PrefixKey(scope, n, d) for n, d in prefix_digests(token_ids, sorted(lengths))]


class PrefixIndex(Generic[State]):
    """PrefixKey -> the states holding it (several: a fork shares its source's tokens)."""

    def __init__(self) -> None:
        self._states: dict[PrefixKey, list[State]] = {}
        self._lengths: dict[str, Counter[int]] = {}  # scope -> how many keys of each length

    def __contains__(self, key: PrefixKey) -> bool:
        return key in self._states

    def add(self, key: PrefixKey, state: State) -> None:
        held = self._states.setdefault(key, [])
        if not held:
            self._lengths.setdefault(key.scope, Counter())[key.length] += 1
        held.append(state)

    def remove(self, key: PrefixKey, state: State) -> None:
        held = self._states[key]
        held.remove(state)
        if held:
            return
        del self._states[key]
        lengths = self._lengths[key.scope]
        lengths[key.length] -= 1
        if not lengths[key.length]:
            del lengths[key.length]
        if not lengths:
            del self._lengths[key.scope]

    def holding(self, key: PrefixKey) -> list[State]:
        """The states named `key` (none: an empty list)."""
        return list(self._states.get(key, ()))

    def longest(self, scope: str, token_ids: list[int], max_length: int) -> tuple[PrefixKey, list[State]] | None:
        """The longest key of `scope` naming a prefix of `token_ids` no longer than max_length."""
        lengths = sorted(n for n in self._lengths.get(scope, ()) if 0 < n <= min(max_length, len(token_ids)))
        best = None
        for length, digest in prefix_digests(token_ids, lengths):
            key = PrefixKey(scope, length, digest)
            if key in self._states:
                best = key
        return None if best is None else (best, self._states[best])

    def items(self) -> Iterator[tuple[PrefixKey, list[State]]]:
        return iter(self._states.items())
