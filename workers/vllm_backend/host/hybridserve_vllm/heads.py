"""The heads an engine host holds, as copies of vLLM's blocks and state pages.

A head is a conversation's state after its committed tokens but the last one (the next turn
runs that token first): per attention layer the KV blocks covering those tokens, per Mamba
layer its state page (conv and SSM state, vLLM's packed bytes). A finished turn's state waits
here *prepared* (by request id) until the worker commits it (it becomes a head, by head id) or
abandons it (dropped: the head it continued is untouched, it was never written).

A head continuing another shares the blocks the turn did not write (every full block before
the loaded length): storing a turn costs its new tokens, not the whole conversation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LayerLayout:
    name: str
    shape: tuple[int, ...]  # one block's (attention) or one state page's (Mamba) shape
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype)}

    @classmethod
    def from_dict(cls, d: dict) -> LayerLayout:
        return cls(d["name"], tuple(d["shape"]), getattr(torch, d["dtype"].removeprefix("torch.")))


@dataclass
class Head:
    num_tokens: int  # tokens the state covers
    blocks: dict[str, list[torch.Tensor]]  # attention layer -> block i holds tokens [i*bs, (i+1)*bs)
    states: dict[str, torch.Tensor]  # Mamba layer -> its state page

    def nbytes(self) -> int:
        kv = sum(b.numel() * b.element_size() for blocks in self.blocks.values() for b in blocks)
        return kv + sum(s.numel() * s.element_size() for s in self.states.values())


class HeadError(KeyError):
    pass


@dataclass
class HeadStore:
    block_size: int = 0
    attention: list[LayerLayout] = field(default_factory=list)  # in the engine's layer order
    mamba: list[LayerLayout] = field(default_factory=list)
    committed: dict[str, Head] = field(default_factory=dict)  # head id -> head
    prepared: dict[str, Head] = field(default_factory=dict)  # request id -> a finished turn's state

    def head(self, head_id: str) -> Head:
        try:
            return self.committed[head_id]
        except KeyError:
            raise HeadError(f"no head {head_id!r} here") from None

    def commit(self, request_id: str, head_id: str) -> int:
        """The prepared state of `request_id` becomes head `head_id`; returns its bytes."""
        try:
            head = self.prepared.pop(request_id)
        except KeyError:
            raise HeadError(f"no prepared turn {request_id!r} here") from None
        self.committed[head_id] = head
        return head.nbytes()

    def abandon(self, request_id: str) -> None:
        self.prepared.pop(request_id, None)

    def drop(self, head_id: str) -> None:
        self.committed.pop(head_id, None)

    # -- export and import: raw bytes, cut as the worker's tier format wants them -------------
    def exporter(self, head_id: str) -> HeadExport:
        """What builds the head's export, part by part: a head is never written after its commit,
        so this runs off the engine thread (a large head's bytes take a while to copy)."""
        head = self.head(head_id)
        return HeadExport(head, self.attention, self.mamba, block_count(head.num_tokens, self.block_size))

    def install(self, head_id: str, num_tokens: int, blocks: list[bytes], state: bytes) -> int:
        """A head from its export's parts (checked against this engine's layout); returns its bytes."""
        if len(blocks) != block_count(num_tokens, self.block_size):
            raise HeadError(f"{len(blocks)} blocks do not cover {num_tokens} tokens")
        head = Head(num_tokens, {layer.name: [] for layer in self.attention}, {})
        for raw in blocks:
            for layer, part in zip(self.attention, _split(raw, self.attention), strict=True):
                head.blocks[layer.name].append(part)
        for layer, part in zip(self.mamba, _split(state, self.mamba), strict=True):
            head.states[layer.name] = part
        self.committed[head_id] = head
        return head.nbytes()


@dataclass(frozen=True)
class HeadExport:
    head: Head
    attention: list[LayerLayout]
    mamba: list[LayerLayout]
    count: int  # block indexes the head covers

    def blocks(self) -> Iterator[bytes]:
        """One part per block index: every attention layer's block, in layer order."""
        for i in range(self.count):
            yield b"".join(_raw(self.head.blocks[layer.name][i]) for layer in self.attention)

    def state(self) -> bytes:
        """The Mamba state pages, in layer order."""
        return b"".join(_raw(self.head.states[layer.name]) for layer in self.mamba)


def block_count(num_tokens: int, block_size: int) -> int:
    """Blocks of block_size covering num_tokens (a started block is a whole one)."""
    return -(-num_tokens // block_size)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _split(raw: bytes, layers: list[LayerLayout]) -> list[torch.Tensor]:
    if len(raw) != sum(layer.nbytes for layer in layers):
        raise HeadError(f"{len(raw)} bytes do not fit the layers' {sum(layer.nbytes for layer in layers)}")
    out, offset = [], 0
    for layer in layers:
        data = torch.frombuffer(bytearray(raw[offset: offset + layer.nbytes]), dtype=torch.uint8)
        out.append(data.view(layer.dtype).reshape(layer.shape))
        offset += layer.nbytes
    return out
