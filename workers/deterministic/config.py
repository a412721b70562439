"""The deterministic path's fixed shapes and knobs (frozen, validated)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeterministicConfig:
    """One verify pass is always `rows` x `window` tokens.

    window:        tile length T = verify window W; tiles sit on absolute positions [kT, (k+1)T)
                   and a key block of the tile attention is one tile long (any KV block size:
                   key blocks are cut at tile boundaries, pages are gathered position by position)
    rows:          G, request rows per verify pass (topped up with dummy rows)
    ssd_chunk:     the fixed chunk of the tile's SSD scan (divides the window)
    num_threads:   torch threads while a verify pass runs (restored afterwards)
    mismatch_rate: probability that a decoded candidate is replaced by another token before
                   it is fed back (tests and benchmarks exercise rollback with it)
    fast_decode:   decode on the fast path and verify (the point of this mode); False makes
                   every token of a deterministic request come from a tile pass of its own
                   (the "everything through the fixed-shape path" baseline of the benchmark)
    """

    window: int = 64  # W = 64, G = 1 measured best on the bench model here (bench/results/determinism.md)
    rows: int = 1
    ssd_chunk: int = 16
    num_threads: int = 2
    mismatch_rate: float = 0.0
    mismatch_seed: int = 0
    fast_decode: bool = True

    def __post_init__(self) -> None:
        if self.window < 1 or self.rows < 1 or self.num_threads < 1:
            raise ValueError(f"window, rows and num_threads must be >= 1: {self}")
        if self.ssd_chunk < 1 or self.window % self.ssd_chunk:
            raise ValueError(f"ssd_chunk must divide the window: {self}")
        if not 0.0 <= self.mismatch_rate <= 1.0:
            raise ValueError(f"mismatch_rate must be in [0, 1]: {self}")
