"""What the vLLM backend keeps in its engine host within a byte budget (conversations' heads,
prefix checkpoints): least recently used first; a pinned entry (a turn or request uses it)
never goes. Which bytes go is decided here at once; the caller drops them in the host."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LruBudget(Generic[K, V]):
    def __init__(self, budget_bytes: int, nbytes: Callable[[V], int], pinned: Callable[[K, V], bool]):
        self.budget_bytes = budget_bytes
        self._nbytes = nbytes
        self._pinned = pinned
        self._held: dict[K, V] = {}  # least recently used first

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: K) -> bool:
        return key in self._held

    def __iter__(self) -> Iterator[V]:
        return iter(list(self._held.values()))

    def get(self, key: K) -> V | None:
        return self._held.get(key)

    @property
    def nbytes(self) -> int:
        return sum(self._nbytes(v) for v in self._held.values())

    def put(self, key: K, value: V) -> None:
        """Held, as the most recently used (the caller keeps within budget after)."""
        self._held.pop(key, None)
        self._held[key] = value

    def touch(self, key: K) -> None:
        self._held[key] = self._held.pop(key)

    def pop(self, key: K) -> V | None:
        return self._held.pop(key, None)

    def over_budget(self) -> list[V]:
        """Take the least recently used unpinned entries until within budget; returns them."""
        used, taken = self.nbytes, []
        for key, value in list(self._held.items()):
            if used <= self.budget_bytes:
                break
            if not self._pinned(key, value):
                used -= self._nbytes(value)
                taken.append(self._held.pop(key))
        return taken
