"""The one small interface every cache manager offers the coordinator and the head manager.

    KVCacheManager      units: KV blocks (shared by reference, copied on write)
    MambaStateManager   units: Mamba state slots (never shared)

Each keeps its own accounting of which holder holds which units; callers move and free
units only through these methods, never by writing a manager's tables.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from workers.cache.holders import CacheUsage
from workers.state_names import Holder


class CacheManager(ABC):
    @property
    @abstractmethod
    def num_free(self) -> int:
        """Units allocatable now."""

    @abstractmethod
    def holders(self) -> Iterable[Holder]:
        """Every holder that holds units."""

    @abstractmethod
    def transfer(self, src: Holder, dst: Holder) -> None:
        """Hand src's units to dst (no copy)."""

    @abstractmethod
    def free(self, holder: Holder) -> None:
        """Release everything the holder holds (nothing if it holds nothing)."""

    @abstractmethod
    def usage(self) -> CacheUsage:
        """free + cached + in use == total, asserted by `CacheUsage.check`."""
