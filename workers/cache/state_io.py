"""Copies of cache tensors for exports and imports: the only part that runs on the engine
thread. Serialization and hashing of the copies happen elsewhere (workers.conversation.export).

    KV copy of n blocks:    [attention layers, 2 (K, V), n, block_size, kv heads, head dim]
    state copy of k slots:  conv [mamba layers, k, conv_dim, conv_width], ssm [mamba layers, k, heads, head dim, d_state]
"""

from __future__ import annotations

import torch

from workers.model.forward_batch import ModelCaches


def read_blocks(caches: ModelCaches, blocks: list[int]) -> torch.Tensor:
    index = torch.tensor(blocks, dtype=torch.long)
    return torch.stack([kv.index_select(1, index) for kv in caches.kv])


def write_blocks(caches: ModelCaches, blocks: list[int], data: torch.Tensor) -> None:
    index = torch.tensor(blocks, dtype=torch.long)
    for layer, kv in enumerate(caches.kv):
        kv[:, index] = data[layer]


def read_slots(caches: ModelCaches, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(slots, dtype=torch.long)
    conv = torch.stack([c.index_select(0, index) for c in caches.conv])
    ssm = torch.stack([s.index_select(0, index) for s in caches.ssm])
    return conv, ssm


def write_slots(caches: ModelCaches, slots: list[int], conv: torch.Tensor, ssm: torch.Tensor) -> None:
    index = torch.tensor(slots, dtype=torch.long)
    for layer, (c, s) in enumerate(zip(caches.conv, caches.ssm)):
        c[index] = conv[layer]
        s[index] = ssm[layer]
