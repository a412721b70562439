"""The model runner: turns a scheduled step into tensors, runs the model, returns logits.

It owns the cache tensors and knows nothing of requests' lifecycles: the scheduler's
output says which tokens run, where their K/V go and which state slot each uses.
"""

from __future__ import annotations

import array

import torch

from workers.cache.coordinator import PendingCopies
from workers.cache.layout import NULL_BLOCK, KVCacheLayout, MambaStateLayout, allocate_caches
from workers.config import WeightQuantization
from workers.kernels.extensions import decode_kernels, scan_kernels
from workers.kernels.fast_path import REFERENCE, FastPath, runs_fast_path
from workers.kernels.linear_plan import LinearPlan, int8_plan
from workers.kernels.linear_tuning import tune_linears
from workers.model.forward_batch import DecodeGroup, ForwardBatch, PrefillSegment
from workers.model.hybrid_lm import HybridLM
from workers.prompt_logprobs import record_prompt_logprobs
from workers.scheduler import ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: HybridLM,
        kv_layout: KVCacheLayout,
        state_layout: MambaStateLayout,
        device: str,
        fast_kernels: bool = True,
        linear_plan: LinearPlan | None = None,
        weight_quantization: WeightQuantization = WeightQuantization.NONE,
    ):
        """`fast_kernels`: run the fast path (`workers.kernels.fast_path`: the C++ kernels when
        they build here, the pure-torch fast variants, and the weight matmuls on the backends
        measured fastest here, `workers.kernels.linear_tuning`, or with INT8 weight quantization
        on int8 panels); False runs the pure-torch reference path (fp32 weights)."""
        self.model = model
        self.device = device
        self.weight_quantization = weight_quantization
        self.set_fast_kernels(fast_kernels, linear_plan)
        self.block_size = kv_layout.block_size
        self.caches = allocate_caches(kv_layout, state_layout, device)

    def set_fast_kernels(self, enabled: bool, linear_plan: LinearPlan | None = None) -> None:
        """Switch between the fast path and the reference path. Turning it on builds (or finds
        built) both C++ kernel modules and measures the weight matmuls (unless `linear_plan` is
        given) here, at start-up, so that no forward on the engine thread ever compiles or
        measures anything; a kernel that cannot be built is None and its reference runs."""
        on = runs_fast_path(self.device, enabled)
        self.fast = FastPath(on=True, decode=decode_kernels(), scan=scan_kernels()) if on else REFERENCE
        self.model.use_fast_path(self.fast)
        if on and linear_plan is not None and linear_plan.quantized != (self.weight_quantization is WeightQuantization.INT8):
            # An int8 plan on an fp32 engine would compute int8 states under an fp32 identity
            # (and its heads could move to fp32 replicas); an fp32 plan on an int8 engine would
            # silently drop the mode.
            kind = "int8" if linear_plan.quantized else "fp32"
            raise ValueError(f"{kind} linear plan for weight_quantization={self.weight_quantization.value}")
        self.linear_plan = (linear_plan or self._plan_linears()) if on else None
        self.model.use_linear_plan(self.linear_plan)

    def _plan_linears(self) -> LinearPlan:
        if self.weight_quantization is WeightQuantization.INT8:
            return int8_plan(self.model.blocks, tune_linears(self.model.blocks))
        return tune_linears(self.model.blocks)

    def apply_copies(self, copies: PendingCopies) -> None:
        """Copy-on-write of tail blocks, copies and zeroing of Mamba states, before the step runs."""
        self.copy_blocks(copies.blocks)
        self.copy_slots(copies.slots)
        if copies.zero_slots:
            dst = torch.tensor(copies.zero_slots, device=self.device)
            for conv, ssm in zip(self.caches.conv, self.caches.ssm):
                conv[dst] = 0
                ssm[dst] = 0

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([d for _, d in pairs], device=self.device)
            for kv in self.caches.kv:
                kv[:, dst] = kv[:, src]

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([d for _, d in pairs], device=self.device)
            for conv, ssm in zip(self.caches.conv, self.caches.ssm):
                conv[dst] = conv[src]
                ssm[dst] = ssm[src]

    # -- copies of cache contents, for exports and imports (engine thread; tensor copies only) --
    #   KV copy of n blocks:    [attention layers, 2 (K, V), n, block_size, kv heads, head dim]
    #   state copy of k slots:  conv [mamba layers, k, conv_dim, conv_width],
    #                           ssm  [mamba layers, k, heads, head dim, d_state]
    # Copies read are host tensors (exports serialise them), whatever the engine's device;
    # copies written may be host tensors.
    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return torch.stack([kv.index_select(1, index) for kv in self.caches.kv]).cpu()

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        for layer, kv in enumerate(self.caches.kv):
            kv[:, index] = data[layer]

    def read_slots(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        conv = torch.stack([c.index_select(0, index) for c in self.caches.conv])
        ssm = torch.stack([s.index_select(0, index) for s in self.caches.ssm])
        return conv.cpu(), ssm.cpu()

    def write_slots(self, slots: list[int], conv: torch.Tensor, ssm: torch.Tensor) -> None:
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        conv, ssm = conv.to(self.device), ssm.to(self.device)
        for layer, (c, s) in enumerate(zip(self.caches.conv, self.caches.ssm)):
            c[index] = conv[layer]
            s[index] = ssm[layer]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Run the step; returns logits [number of sampling chunks, vocab] in chunk order (the
        prompt logprobs a request asked for are written into it: workers/prompt_logprobs.py)."""
        self.apply_copies(step.copies)
        batch, sample_rows = self.build_batch(step.chunks)
        hidden = self.model(batch, self.caches)
        record_prompt_logprobs(self.model, hidden, step.chunks)
        return self.model.compute_logits(hidden if sample_rows is None else hidden[sample_rows])

    def build_batch(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, torch.Tensor | None]:
        """The step's flat batch, and the rows whose logits are sampled (None: every row, in
        order, as in a pure decode step, so no gather)."""
        if chunks and self.fast.decode is not None and all(c.num_tokens == 1 and c.start > 0 for c in chunks):
            return self._decode_batch(chunks), None
        return self._mixed_batch(chunks)

    def _mixed_batch(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, torch.Tensor | None]:
        """Any step (prefill segments and a decode group); the reference of `_decode_batch`."""
        ids: list[int] = []
        positions: list[int] = []
        kv_slots: list[int] = []
        prefills: list[PrefillSegment] = []
        decode_rows: list[int] = []
        decode_chunks: list[ScheduledChunk] = []
        sample_rows: list[int] = []
        bs = self.block_size
        for chunk in chunks:
            row = len(ids)
            ids.extend(chunk.token_ids)
            span = range(chunk.start, chunk.start + chunk.num_tokens)
            positions.extend(span)
            table = chunk.block_table
            kv_slots.extend(table[p // bs] * bs + p % bs for p in span)
            if chunk.num_tokens == 1 and chunk.start > 0:
                decode_rows.append(row)
                decode_chunks.append(chunk)
            else:
                prefills.extend(self._segments(row, chunk))
            if chunk.samples:
                sample_rows.append(row + chunk.num_tokens - 1)
        batch = ForwardBatch(
            input_ids=self._long_tensor(ids),
            positions=self._long_tensor(positions),
            kv_slots=self._long_tensor(kv_slots),
            prefills=tuple(prefills),
            decode=self._decode_group(decode_rows, decode_chunks, covers_batch=not prefills),
        )
        if sample_rows == list(range(len(ids))):
            return batch, None
        return batch, torch.tensor(sample_rows, device=self.device, dtype=torch.long)

    def _decode_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """`build_batch` of a pure decode step on the fused kernels (rows in chunk order, states
        updated in place at any slots), from one host list copied into one tensor:

            flat = [ ids | positions | kv slots | state slots | block tables, B rows x width ]
                      B      B           B           B
            positions == context lens (each sequence has `start` tokens cached)
        """
        bs, n = self.block_size, len(chunks)
        width = max(c.start for c in chunks) // bs + 1  # blocks covering position `start` of the longest
        ids, positions, kv_slots, slots, tables, snap = [], [], [], [], [], []
        for i, c in enumerate(chunks):
            p, table = c.start, c.block_table
            ids.append(c.request.token_ids[p])
            positions.append(p)
            kv_slots.append(table[p // bs] * bs + p % bs)
            slots.append(c.state_slot)
            row = table[:width]
            tables += row
            if len(row) < width:
                tables += [NULL_BLOCK] * (width - len(row))
            if c.snapshot is not None:
                snap.append((i, c.snapshot[1]))
        flat = self._long_tensor(ids + positions + kv_slots + slots + tables)
        first = slots[0]
        return ForwardBatch(
            input_ids=flat[:n],
            positions=flat[n : 2 * n],
            kv_slots=flat[2 * n : 3 * n],
            prefills=(),
            decode=DecodeGroup(
                token_index=torch.arange(n, device=self.device),
                context_lens=flat[n : 2 * n],
                block_tables=flat[4 * n :].view(n, width),
                state_slots=flat[3 * n : 4 * n],
                slot_run=first if slots == list(range(first, first + n)) else None,
                snapshot_rows=torch.tensor([i for i, _ in snap], device=self.device) if snap else None,
                snapshot_slots=torch.tensor([s for _, s in snap], device=self.device) if snap else None,
                covers_batch=True,
            ),
        )

    def _long_tensor(self, values: list[int]) -> torch.Tensor:
        """An int64 tensor of a list of ints: through a C array (torch.tensor reads a list an
        element at a time, ~0.15 us each: 80 us for a decode step of 32 sequences)."""
        host = torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)
        return host if self.device == "cpu" else host.to(self.device)

    def _segments(self, row: int, chunk: ScheduledChunk) -> list[PrefillSegment]:
        r"""One segment per chunk, or more when the Mamba state must be snapshot inside it (the
        aligned snapshot, checkpoint marks at message boundaries):

            chunk [start ........ a ..... m ..... end)     a, m = snapshot positions
                  \_ segment 1 _/\_ seg 2 _/\_ seg 3 _/  the state after segments 1, 2 is copied
        """
        end = chunk.start + chunk.num_tokens
        table = torch.tensor(chunk.block_table[: -(-end // self.block_size)], device=self.device)
        cuts: dict[int, list[int]] = {}
        for position, slot in chunk.snapshots:
            cuts.setdefault(position, []).append(slot)
        segments, start = [], chunk.start
        for position in sorted(cuts):
            segments.append(PrefillSegment(
                row + start - chunk.start, position - start, start, table, chunk.state_slot, tuple(cuts[position])))
            start = position
        if start < end:
            segments.append(PrefillSegment(row + start - chunk.start, end - start, start, table, chunk.state_slot))
        return segments

    def _decode_group(self, rows: list[int], chunks: list[ScheduledChunk], covers_batch: bool) -> DecodeGroup | None:
        if not chunks:
            return None
        bs = self.block_size
        if self.fast.decode is None:  # the reference updates contiguous slots in place: sort to find runs
            order = sorted(range(len(chunks)), key=lambda i: chunks[i].state_slot)
            rows, chunks = [rows[i] for i in order], [chunks[i] for i in order]
        # The fused kernels update any slots in place, so rows stay in batch order.
        first = chunks[0].state_slot
        contiguous = all(c.state_slot == first + i for i, c in enumerate(chunks))
        width = max(-(-(c.start + 1) // bs) for c in chunks)
        tables = [c.block_table[:width] + [NULL_BLOCK] * (width - len(c.block_table[:width])) for c in chunks]
        snap = [(i, c.snapshot[1]) for i, c in enumerate(chunks) if c.snapshot is not None]
        return DecodeGroup(
            token_index=torch.tensor(rows, device=self.device),
            context_lens=torch.tensor([c.start for c in chunks], device=self.device),
            block_tables=torch.tensor(tables, device=self.device),
            state_slots=torch.tensor([c.state_slot for c in chunks], device=self.device),
            slot_run=first if contiguous else None,
            snapshot_rows=torch.tensor([i for i, _ in snap], device=self.device) if snap else None,
            snapshot_slots=torch.tensor([s for _, s in snap], device=self.device) if snap else None,
            covers_batch=covers_batch and rows == list(range(len(rows))),
        )
