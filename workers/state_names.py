"""The names of cached state that requests and the cache managers share: who holds a resource
(`Holder`: a running request, a prepared turn, a committed head or a prefix checkpoint) and which
token prefix a state covers (`PrefixKey`, see workers/cache/prefix_index.py).

Both workers/request.py and workers/cache/ name state this way, so these names live below both:
the cache package imports requests, requests import only these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class HolderKind(Enum):
    REQUEST = "request"
    PREPARED = "prepared"  # a finished turn's state awaiting commit or abandon
    HEAD = "head"
    CHECKPOINT = "checkpoint"  # the state at a prefix of some prompt, owned by no conversation
    MARK = "mark"  # a checkpoint being made: a slot a running request's prefill will snapshot into

    @property
    def cached(self) -> bool:
        """Evictable: nothing running needs it."""
        return self in (HolderKind.HEAD, HolderKind.CHECKPOINT)


@dataclass(frozen=True)
class Holder:
    kind: HolderKind
    id: str | int  # the request id (REQUEST), or a serial of the head manager (PREPARED, HEAD)

    @staticmethod
    def request(request_id: str) -> Holder:
        return Holder(HolderKind.REQUEST, request_id)

    @staticmethod
    def prepared(serial: int) -> Holder:
        return Holder(HolderKind.PREPARED, serial)

    @staticmethod
    def head(serial: int) -> Holder:
        return Holder(HolderKind.HEAD, serial)


@dataclass(frozen=True)
class PrefixKey:
    scope: str
    length: int
    digest: str  # proto.contract.tokens_digest of the prefix's token ids
