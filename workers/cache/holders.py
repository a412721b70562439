"""Who holds a cache resource: a running request, or a committed conversation head.

Requests' resources are "in use"; resources held only by heads are "cached" (evictable);
the rest are "free". Both managers report the same triple and assert it adds up.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class HolderKind(Enum):
    REQUEST = "request"
    HEAD = "head"


@dataclass(frozen=True)
class Holder:
    kind: HolderKind
    key: str

    @staticmethod
    def request(request_id: str) -> Holder:
        return Holder(HolderKind.REQUEST, request_id)

    @staticmethod
    def head(head_key: str) -> Holder:
        return Holder(HolderKind.HEAD, head_key)


@dataclass(frozen=True)
class CacheUsage:
    free: int
    cached: int
    in_use: int
    total: int

    def check(self, what: str) -> None:
        assert self.free + self.cached + self.in_use == self.total, f"{what} integrity: {self}"
