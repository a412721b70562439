"""hybridserve's KV connector for vLLM: exact conversation heads inside vLLM's engine.

vLLM loads it by module path (`kv_connector_module_path`); it runs in the engine host's process
with vLLM's prefix caching off (Mamba cache mode "none": one state page per request).

    scheduler side                                   worker side (same process: STORE is shared)
    get_num_new_matched_tokens: the request's        start_load_kv: copy the head's KV blocks into
      kv_transfer_params name a head and its length    the request's first blocks and its Mamba
      -> that many tokens are computed already          states into the request's state pages
    request_finished_all_groups: a turn that asked   wait_for_save: copy the finished request's
      to be captured keeps its blocks (delay free)     blocks and pages into STORE.prepared,
      and is saved in the next step                    then report it sent (its blocks are freed)

A loaded length is always shorter than the prompt: vLLM must compute at least one token (the
worker's heads cover the committed tokens but the last one, which the next turn runs first).
Loads are synchronous: the copy is done before the step's forward reads the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import RequestStatus

from hybridserve_vllm.heads import Head, HeadStore, LayerLayout, block_count

# The engine runs in the host's process (in-process engine core, one worker): the worker-side
# connector fills this store and the host resolves, exports and installs heads in it.
STORE = HeadStore()

# A stop string ends a request by aborting it in the core (vLLM's detokenizer finds it): aborted
# requests are captured too, and the host drops those the worker aborted.
_CAPTURED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class Load:
    request_id: str
    head_id: str
    num_tokens: int
    block_ids: tuple[list[int], ...]  # per KV cache group


@dataclass(frozen=True)
class Save:
    request_id: str
    key: str  # the host's name of the request (vLLM's own id may carry a suffix)
    num_tokens: int
    block_ids: tuple[list[int], ...]
    base: tuple[str, int] | None  # (head id, tokens) the request loaded: its full blocks are shared


@dataclass
class HeadTransfers(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


def wants(request, key: str, default: Any = None) -> Any:
    return (request.kv_transfer_params or {}).get(key, default)


class HeadConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._pending = HeadTransfers()
        self._layer_group: dict[str, int] = {}
        self._mamba_layers: set[str] = set()
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups if kv_cache_config else ()):
            for name in group.layer_names:
                self._layer_group[name] = group_id
                if isinstance(group.kv_cache_spec, MambaSpec):
                    self._mamba_layers.add(name)
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config else 0
        self._block_size = vllm_config.cache_config.block_size
        self._caches: dict[str, tuple[torch.Tensor, int]] = {}  # layer -> (cache, its block dim)
        self._sent: set[str] = set()

    # -- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = wants(request, "load_tokens", 0)
        if not tokens or num_computed_tokens >= tokens or tokens >= request.num_tokens:
            return 0, False
        return tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens:
            self._pending.loads.append(Load(
                request.request_id, wants(request, "load_head"), request.num_computed_tokens + num_external_tokens,
                tuple(list(ids) for ids in blocks.get_block_ids())))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._pending = self._pending, HeadTransfers()
        return meta

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        if not wants(request, "capture") or request.status not in _CAPTURED:
            return False, None
        head, tokens = wants(request, "load_head"), wants(request, "load_tokens", 0)
        self._pending.saves.append(Save(
            request.request_id, wants(request, "capture"), request.num_computed_tokens,
            tuple(list(ids) for ids in block_ids),
            (head, tokens) if head and tokens else None))
        return True, None  # the blocks stay until the save reports the request sent

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        STORE.block_size = self._block_size
        STORE.attention.clear()
        STORE.mamba.clear()
        for name, cache in kv_caches.items():
            dim = _block_dim(cache, self._num_blocks)
            self._caches[name] = (cache, dim)
            one = cache.select(dim, 0)
            layout = LayerLayout(name, tuple(one.shape), one.dtype)
            (STORE.mamba if name in self._mamba_layers else STORE.attention).append(layout)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HeadTransfers):
            return
        for load in meta.loads:
            head = STORE.head(load.head_id)
            if head.num_tokens < load.num_tokens:
                raise RuntimeError(f"head {load.head_id!r} covers {head.num_tokens} tokens, not {load.num_tokens}")
            for name, (cache, dim) in self._caches.items():
                ids = load.block_ids[self._layer_group[name]]
                if name in self._mamba_layers:
                    cache.select(dim, ids[0]).copy_(head.states[name])
                else:
                    for i in range(block_count(load.num_tokens, self._block_size)):
                        cache.select(dim, ids[i]).copy_(head.blocks[name][i])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # a head is captured whole at its request's end

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HeadTransfers):
            return
        for save in meta.saves:
            STORE.prepared[save.key] = self._capture(save)
            self._sent.add(save.request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self._sent = self._sent, set()
        return sent or None, None

    def _capture(self, save: Save) -> Head:
        """The request's blocks and pages as a head. The last block's slots past its tokens hold
        zeros, not another request's KV: vLLM zeroes attention blocks when it hands them out
        (`new_block_ids_to_zero`), and only this request wrote to them since. (The slots are
        not addressable here: CPU attention packs a block's tokens and channels together.)"""
        base = STORE.committed.get(save.base[0]) if save.base else None
        shared = min(save.base[1], base.num_tokens) // self._block_size if base else 0
        head = Head(save.num_tokens, {}, {})
        for name, (cache, dim) in self._caches.items():
            ids = save.block_ids[self._layer_group[name]]
            if name in self._mamba_layers:
                head.states[name] = cache.select(dim, ids[0]).clone()
            else:
                count = block_count(save.num_tokens, self._block_size)
                head.blocks[name] = [
                    base.blocks[name][i] if i < shared else cache.select(dim, ids[i]).clone() for i in range(count)]
        return head



def _block_dim(cache: torch.Tensor, num_blocks: int) -> int:
    """The dimension that indexes blocks (0 on CPU; 1 in the [2, blocks, ...] layouts of GPUs)."""
    for dim, size in enumerate(cache.shape):
        if size == num_blocks:
            return dim
    raise RuntimeError(f"no dimension of {num_blocks} blocks in a cache of shape {tuple(cache.shape)}")
