"""Frozen, validated configuration of the engine (no environment variables read deeper in)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per step: prefill chunks + decodes

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"scheduler limits must be >= 1: {self}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_bytes: int = 512 << 20
    num_state_slots: int = 0  # 0: twice max_num_seqs, plus room for retained heads
    head_cache_bytes: int = 256 << 20  # budget for committed conversation heads (evictable)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.kv_cache_bytes <= 0 or self.num_state_slots < 0:
            raise ValueError(f"invalid cache config: {self}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    num_threads: int = 0  # 0: leave torch's default
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
