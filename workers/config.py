"""Frozen, validated configuration of the engine (no environment variables read deeper in)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.deterministic.config import DeterministicConfig
from workers.model.device import parse_device
from workers.quantization import WeightQuantization  # re-exported: its home imports no torch


# Weight/activation dtypes the model runs in (Mamba states stay fp32 in all of them).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    # 0: twice max_num_seqs (a turn that will publish holds a running state and an aligned
    # snapshot), plus room for retained heads (two slots each) within head_cache_bytes.
    num_state_slots: int = 0
    head_cache_bytes: int = 256 << 20  # budget for committed conversation heads (evictable)
    # budget for prefix checkpoints (message boundaries, finished stateless requests); 0: none kept
    prefix_cache_bytes: int = 128 << 20
    mamba_align_tokens: int = 0  # aligned Mamba snapshots every N tokens; 0: the block size
    prepared_turn_timeout_s: float = 60.0  # a prepared turn never committed or abandoned is abandoned
    # A state whose reply ended in tool calls waits for the tools' results: for this long after
    # its last use it is evicted only after every other idle state (0: no such protection).
    tool_pause_s: float = 300.0
    # The share of prefix_cache_bytes (and of its state slots) that such states hold safe from
    # marks during their pause, the most recently used first; a mark may evict older ones past
    # it (least recently used first), so ends nobody resumes cannot keep a replica from holding
    # shared prefixes. 1: no mark evicts any; 0: marks evict them after every other checkpoint.
    tool_pause_share: float = 0.5

    @property
    def align_tokens(self) -> int:
        return self.mamba_align_tokens or self.block_size

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.kv_cache_bytes <= 0 or self.num_state_slots < 0 or self.prefix_cache_bytes < 0:
            raise ValueError(f"invalid cache config: {self}")
        if self.mamba_align_tokens % self.block_size:
            raise ValueError("mamba_align_tokens must be a multiple of block_size")
        if self.tool_pause_s < 0:
            raise ValueError(f"tool_pause_s must be >= 0: {self.tool_pause_s!r}")
        if not 0 <= self.tool_pause_share <= 1:
            raise ValueError(f"tool_pause_share must be in [0, 1]: {self.tool_pause_share!r}")
        if not self.prepared_turn_timeout_s > 0:
            raise ValueError(f"prepared_turn_timeout_s must be > 0: {self.prepared_turn_timeout_s!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # cpu, or cuda[:N] (the reference path; bf16 is its usual dtype): workers.model.device
    num_threads: int = 0  # 0: leave torch's default
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    deterministic: DeterministicConfig = field(default_factory=DeterministicConfig)
    weight_quantization: WeightQuantization = WeightQuantization.NONE

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ValueError(f"dtype {self.dtype} is not supported: choose one of {names}")
        parse_device(self.device)  # "meta", "mps", a typo: refused here, not inside the first forward
        quantization = WeightQuantization(self.weight_quantization)  # a bad name is a ValueError here
        if quantization is not WeightQuantization.NONE and (self.dtype != torch.float32 or self.device != "cpu"):
            raise ValueError(
                f"weight_quantization={quantization.value} runs on fp32 CPU engines only, not {self.dtype} on {self.device}"
            )
        object.__setattr__(self, "weight_quantization", quantization)
