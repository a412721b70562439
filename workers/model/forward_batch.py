r"""What one forward pass needs besides weights: the flat token batch and where its state lives.

The runner builds a `ForwardBatch` from the scheduler's step; the layers read it. Tokens of
all sequences are concatenated into one flat array so the dense layers (projections, MLPs)
run as one matmul; only the sequence mixers (attention, Mamba) look at sequence bounds.

    flat tokens:  [ seq A prefill chunk (5) | seq B prefill chunk (3) | C | D | E ]
                    ^ PrefillSegment(start=0, n=5)     ^ start=5, n=3   \_decode group_/
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class PrefillSegment:
    """A run of several tokens of one sequence, continuing from `context_len` cached tokens."""

    token_start: int
    num_tokens: int
    context_len: int
    block_table: torch.Tensor  # [blocks covering positions < context_len + num_tokens], long
    state_slot: int
    snapshot_slots: tuple[int, ...] = ()  # copy the Mamba state here after this segment


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences advancing by exactly one token each, computed together."""

    token_index: torch.Tensor  # [B] positions in the flat token array, long
    context_lens: torch.Tensor  # [B] tokens cached before this one, long
    block_tables: torch.Tensor  # [B, max_blocks] padded with the null block, long
    state_slots: torch.Tensor  # [B], long
    slot_run: int | None = None  # when state_slots == run, run+1, ..., run+B-1: updated in place
    snapshot_rows: torch.Tensor | None = None  # rows whose state is also copied, after the step,
    snapshot_slots: torch.Tensor | None = None  # into these slots
    covers_batch: bool = False  # token_index == 0..B-1 and nothing else runs: no gather/scatter of rows

    @cached_property
    def num_keys(self) -> torch.Tensor:
        """[B] keys each sequence's query sees (its history and itself): made once per step,
        read by every attention layer."""
        return self.context_lens + 1


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long, absolute position of each token
    kv_slots: torch.Tensor  # [N] long, block * block_size + offset where each token's K/V go
    prefills: tuple[PrefillSegment, ...]
    decode: DecodeGroup | None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def pure_decode(self) -> DecodeGroup | None:
        """The decode group when it is the whole step, rows in order (`covers_batch`): the layers'
        fused paths run it without gathering or scattering rows. None otherwise."""
        return self.decode if self.decode is not None and self.decode.covers_batch else None


@dataclass
class ModelCaches:
    """The state tensors a model reads and writes, indexed per layer of each kind.

    kv[i]:   [2, num_blocks, block_size, n_kv_heads, head_dim] for the i-th attention layer
    conv[j]: [num_slots, conv_dim, d_conv - 1]   the last d_conv-1 inputs of the j-th Mamba layer
    ssm[j]:  [num_slots, n_heads, head_dim, d_state]
    """

    kv: list[torch.Tensor]
    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
