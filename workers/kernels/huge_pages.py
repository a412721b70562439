"""The weights of the weight matmuls on transparent huge pages (2 MB instead of 4 KB).

Every forward streams all the weights (and their packed panels) once: hundreds of MB read
through 4 KB pages, a TLB miss and a fresh page walk every 4 KB, and the hardware prefetchers
stop at each page boundary. Copied once at start-up into one private anonymous mapping advised
`MADV_HUGEPAGE`, the kernel backs them with 2 MB pages where it has them (THP `enabled` set
to `always` or `madvise`, the common defaults). Measured on the bench Granite checkpoint, 2
threads, processes alternated with and without, medians: the 64 weight matmuls at 8 rows
19.3 -> 16.0 ms (a pass over the weights at memory speed); the whole decode step at 8
sequences 27.5 -> 23.6 ms and 29.4 -> 26.3 ms (two series); at 32 sequences, where the
matmuls are compute-bound, 67.2 -> 64.8 ms, within the noise; prefills unchanged within it.

Only these buffers, not the whole process (torch's `THP_MEM_ALLOC_ENABLE=1`): with every
large allocation on huge pages, measured here, a 1,024-token prefill got slower (likely its
activations, allocated and freed every layer, each first touch now zeroing 2 MB) and so did
the 32-sequence decode step (likely the Mamba state pool's fixed slot stride). The KV blocks
on such a mapping showed no gain at 2k and 8k histories (3 alternated pairs), so they stay.
oneDNN's packed weights are opaque tensors that cannot be placed: they stay where oneDNN put
them.

Same values, same 64-byte alignment class as torch's allocator (every copy starts on a 4 KB
boundary): no result changes, whichever backend multiplies.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
_START = 4096  # each copy starts on a page boundary


def can_advise() -> bool:
    """Whether this OS takes the huge-page advice (Linux; elsewhere the tensors stay put)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def _span(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // _START) * _START


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors` (dense CPU tensors), one after another in one mapping
    advised for huge pages; the mapping lives as long as any of the copies. Where the advice
    is not available, the tensors themselves."""
    if not tensors or not can_advise():
        return list(tensors)
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise ValueError(f"on_huge_pages takes dense CPU tensors, got {t.layout} on {t.device}")
    total = sum(_span(t) for t in tensors)
    # One huge page more than needed, so the copies can start on a 2 MB boundary.
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the faults then take 2 MB pages
    memory = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` while any view lives
    offset = -memory.data_ptr() % HUGE_PAGE
    copies = []
    # Plain tensors even when called under inference mode: they become parameters' data.
    with torch.inference_mode(False), torch.no_grad():
        for t in tensors:
            size = t.numel() * t.element_size()
            copy = memory[offset : offset + size].view(t.dtype).view(t.shape)
            copy.copy_(t)
            copies.append(copy)
            offset += _span(t)
    return copies
