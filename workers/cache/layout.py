"""Frozen descriptions of the two cache groups and the tensors they allocate.

KV:    per attention layer [2, num_blocks, block_size, n_kv_heads, head_dim]; block 0 is the
       null block that pads block tables and is never handed out.
Mamba: per Mamba layer a conv state [num_slots, conv_dim, d_conv - 1] and an SSM state
       [num_slots, n_heads, head_dim, d_state]; one slot is the whole recurrent state of one
       sequence at one position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model.config import HybridModelConfig
from workers.model.forward_batch import ModelCaches

NULL_BLOCK = 0


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all attention layers (K and V)."""
        return 2 * self.num_layers * self.block_size * self.n_kv_heads * self.head_dim * _itemsize(self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1  # minus the null block

    def allocate(self, device: str) -> list[torch.Tensor]:
        shape = (2, self.num_blocks, self.block_size, self.n_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]


@dataclass(frozen=True)
class MambaStateLayout:
    num_layers: int
    num_slots: int
    conv_dim: int
    conv_width: int  # d_conv - 1 cached inputs
    n_heads: int
    head_dim: int
    d_state: int
    dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        per_layer = self.conv_dim * self.conv_width + self.n_heads * self.head_dim * self.d_state
        return self.num_layers * per_layer * _itemsize(self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def allocate(self, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        conv = [
            torch.zeros(self.num_slots, self.conv_dim, self.conv_width, dtype=self.dtype, device=device)
            for _ in range(self.num_layers)
        ]
        ssm = [
            torch.zeros(self.num_slots, self.n_heads, self.head_dim, self.d_state, dtype=self.dtype, device=device)
            for _ in range(self.num_layers)
        ]
        return conv, ssm


def layouts_for(
    config: HybridModelConfig, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype
) -> tuple[KVCacheLayout, MambaStateLayout]:
    attn, mamba = config.attention, config.mamba
    kv = KVCacheLayout(len(config.attention_layers), num_blocks, block_size, attn.n_kv_heads, attn.head_dim, dtype)
    # SSM states stay fp32 whatever the weights: the recurrence accumulates over thousands of tokens.
    state = MambaStateLayout(
        len(config.mamba_layers),
        num_slots,
        mamba.conv_dim,
        mamba.d_conv - 1,
        mamba.n_heads,
        mamba.head_dim,
        mamba.d_state,
        torch.float32,
    )
    return kv, state


def allocate_caches(kv: KVCacheLayout, state: MambaStateLayout, device: str) -> ModelCaches:
    conv, ssm = state.allocate(device)
    return ModelCaches(kv=kv.allocate(device), conv=conv, ssm=ssm)
