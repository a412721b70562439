"""The fixed-shape tile: close to the fast path, and a row's bits depend on nothing but the
row (its neighbours, its place in the pass, tokens after its valid length)."""

from __future__ import annotations

import pytest
import torch

from workers.cache.layout import allocate_caches, layouts_for
from workers.checkpoint import Arch
from workers.deterministic.tile_attention import gather_key_block, tile_attention
from workers.deterministic.tile_model import TileBatch, TileModel
from workers.deterministic.tile_ssd import state_at
from workers.model.loader import load_model
from workers.request import Request
from workers.runner import ModelRunner
from workers.sampling import SamplingParams
from workers.scheduler import ScheduledChunk

T, BS, G = 16, 4, 4


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 100, (n,), generator=g).tolist()


class Tiles:
    """Runs a sequence through consecutive tiles in one row of G, the others filled at will."""

    def __init__(self, model_dir):
        self.model = load_model(model_dir)
        self.kv, self.state = layouts_for(self.model.config, 64, BS, 4, torch.float32)
        self.caches = allocate_caches(self.kv, self.state, "cpu")
        self.tiles = TileModel(self.model, self.caches, ssd_chunk=8)

    def run(self, ids: list[int], row: int, others: dict[int, list[int]], valid: int | None = None):
        """Tiles over `ids` in `row` (pages 1.. for it; rows in `others` get their own pages
        and tokens); returns the logits of every valid position and the final states."""
        cfg = self.model.config.mamba
        conv = {r: [torch.zeros(cfg.conv_dim, cfg.d_conv - 1) for _ in self.caches.conv] for r in range(G)}
        ssm = {r: [torch.zeros(cfg.n_heads, cfg.head_dim, cfg.d_state) for _ in self.caches.ssm] for r in range(G)}
        seqs = {row: ids, **others}
        pages = {r: list(range(1 + 16 * r, 17 + 16 * r)) for r in seqs}
        logits, tiles = [], -(-len(ids) // T)
        for k in range(tiles):
            inp = torch.zeros(G, T, dtype=torch.long)
            pos = torch.arange(T)[None].repeat(G, 1)
            hist = torch.zeros(G, dtype=torch.long)
            tables = torch.zeros(G, k * T // BS, dtype=torch.long)
            lengths = torch.zeros(G, dtype=torch.long)
            for r, seq in seqs.items():
                chunk = seq[k * T : (k + 1) * T]
                if not chunk:
                    continue
                inp[r, : len(chunk)] = torch.tensor(chunk)
                pos[r] += k * T
                hist[r] = k
                tables[r] = torch.tensor(pages[r][: k * T // BS])
                lengths[r] = len(chunk) if r != row or valid is None or k < tiles - 1 else valid - k * T
            batch = TileBatch(
                inp, pos, tables, hist,
                [torch.stack([conv[r][i] for r in range(G)]) for i in range(len(self.caches.conv))],
                [torch.stack([ssm[r][i] for r in range(G)]) for i in range(len(self.caches.ssm))],
            )
            out = self.tiles.forward(batch)
            logits.append(out.logits[row, : lengths[row]])
            for r in seqs:
                p = torch.tensor(pages[r][k * T // BS : (k + 1) * T // BS])
                for cache, keys, values in zip(self.caches.kv, out.keys, out.values):
                    cache[0, p] = keys[r].reshape(-1, BS, *keys.shape[2:])
                    cache[1, p] = values[r].reshape(-1, BS, *values.shape[2:])
            for i, scan in enumerate(out.scans):
                c, s = state_at(scan, lengths, cfg.d_conv)
                for r in seqs:
                    conv[r][i], ssm[r][i] = c[r], s[r]
        return torch.cat(logits), conv[row], ssm[row]


@pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
def test_tiles_match_the_fast_path(det_models, arch):
    tiles = Tiles(det_models[arch])
    ids = _ids(45, 0)
    logits, conv, ssm = tiles.run(ids, row=1, others={})
    runner = ModelRunner(tiles.model, tiles.kv, tiles.state, "cpu")
    table = list(range(30, 30 + 12))
    request = Request("ref", ids, SamplingParams(max_tokens=1))
    batch, _ = runner.build_batch([ScheduledChunk(request, 0, len(ids), table, state_slot=2)])
    with torch.inference_mode():
        ref = tiles.model.compute_logits(tiles.model(batch, runner.caches))
    assert float(((logits - ref) / ref.std()).abs().max()) < 1e-4
    for mine, theirs in zip(ssm, runner.caches.ssm):
        torch.testing.assert_close(mine, theirs[2], atol=1e-5, rtol=1e-4)
    for mine, theirs in zip(conv, runner.caches.conv):
        torch.testing.assert_close(mine, theirs[2], atol=1e-5, rtol=1e-4)


def test_a_rows_bits_ignore_its_neighbours_and_its_place(det_models):
    tiles = Tiles(det_models[Arch.BAMBA])
    ids = _ids(40, 1)
    alone = tiles.run(ids, row=0, others={})
    crowded = tiles.run(ids, row=2, others={0: _ids(47, 2), 1: _ids(9, 3), 3: _ids(60, 4)})
    assert alone[0].equal(crowded[0])
    assert all(a.equal(b) for a, b in zip(alone[1] + alone[2], crowded[1] + crowded[2]))


def test_a_partial_tile_gives_the_bits_of_the_full_tile(det_models):
    """Tokens after a row's valid length (later candidates, padding) change none of its bits,
    and the state at the valid length is the same as if the tile had ended there."""
    tiles = Tiles(det_models[Arch.NEMOTRON_H])
    ids = _ids(38, 5)
    short = tiles.run(ids, row=1, others={})
    longer = tiles.run(ids + _ids(10, 6), row=1, others={}, valid=38)
    assert short[0].equal(longer[0][:38])
    assert all(a.equal(b) for a, b in zip(short[1] + short[2], longer[1] + longer[2]))


def _paged(keys: torch.Tensor, bs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [G, L, kv, d] stored in pages of `bs` positions, in a shuffled order (page 0 is the
    null page): (cache [pages, bs, kv, d], tables [G, ceil(L / bs)])."""
    g, n = keys.shape[:2]
    per_row = -(-n // bs)
    order = torch.randperm(g * per_row, generator=torch.Generator().manual_seed(seed)) + 1
    cache = torch.full((1 + g * per_row, bs, *keys.shape[2:]), float("nan"))
    tables = order.view(g, per_row)
    padded = torch.cat([keys, torch.zeros(g, per_row * bs - n, *keys.shape[2:])], dim=1)
    cache[tables.flatten()] = padded.reshape(g * per_row, bs, *keys.shape[2:])
    return cache, tables


@pytest.mark.parametrize("bs", [4, 6, 16, 40, 544])
def test_key_blocks_follow_the_tile_grid_whatever_the_page_size(bs):
    """A key block is positions [jT, (j+1)T) whether pages divide T, straddle its edges or
    hold several tiles; tile attention over them has the bits of contiguous keys."""
    g, h, kv, d, k_hist = 3, 4, 2, 8, 3
    gen = torch.Generator().manual_seed(7)
    history_k, history_v = (torch.randn(g, k_hist * T, kv, d, generator=gen) for _ in range(2))
    q, k, v = torch.randn(g, T, h, d, generator=gen), torch.randn(g, T, kv, d, generator=gen), torch.randn(g, T, kv, d, generator=gen)
    blocks = torch.tensor([3, 1, 0])  # rows with fewer tiles of history see the rest masked
    outputs = []
    for size in (T, bs):
        keys, tables = _paged(history_k, size, seed=size)
        values, _ = _paged(history_v, size, seed=size)
        for j in range(k_hist):
            assert gather_key_block(keys, tables, j, T).equal(history_k[:, j * T : (j + 1) * T])
            assert gather_key_block(values, tables, j, T).equal(history_v[:, j * T : (j + 1) * T])
        null_padded = tables.masked_fill(torch.arange(tables.shape[1])[None] * size >= blocks[:, None] * T, 0)
        cache = torch.stack([keys, values]).nan_to_num(0.0)
        outputs.append(tile_attention(q, k, v, cache, null_padded, blocks, 0.3))
    assert outputs[0].equal(outputs[1])
