r"""Verify deterministic requests' decoded tokens in fixed-shape tiles; accept or roll back.

    token_ids:   [ prompt ... | verified outputs | candidates c c c ]
                  <-------- num_verified ------->
    tiles:       [0, T) [T, 2T) ... [kT ........................ (k+1)T)
                                     ^ aligned_len = kT: the KV of positions < kT and the
                                       aligned Mamba slot (state at kT) are canonical

A pass replays tokens [kT, e) of each row, e = min((k+1)T, num_tokens). The logits at
position q give the verifier's token for index q+1. Walking from index num_verified:

    index:       ... v  | c  c  c  c        c = candidate decoded on the fast path
    verifier:           | c  c  x           equal -> accepted; first difference (or no
                                 ^ a         candidate left) -> the verifier's token x is taken,
                                             the rest is dropped (rollback)

`a` is then the newest verified token; the committed state covers [0, a): the tile's K/V of
positions [kT, a) overwrite whatever the fast path wrote, and the Mamba state is rebuilt at
a from the tile's scan inputs (and becomes the aligned state when a closes the tile). A
prefill tile decides no token when the prompt goes on past it: a = e = (k+1)T.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from workers.cache.coordinator import CacheCoordinator
from workers.deterministic.config import DeterministicConfig
from workers.deterministic.metrics import DeterministicMetrics
from workers.deterministic.tile_model import TileBatch, TileModel, TileResult
from workers.deterministic.tile_ssd import state_at
from workers.model.forward_batch import ModelCaches
from workers.model.hybrid_lm import HybridLM
from workers.logits_processors import TokenHistory
from workers.request import Request
from workers.sampling import SampledToken, sample


@dataclass(frozen=True)
class Verdict:
    """What a pass decided for one request, before the engine applies stop conditions."""

    request: Request
    row: int
    tile_start: int  # kT
    end: int  # tokens [kT, end) were replayed
    first: int  # index of the first token decided (= num_verified before the pass)
    tokens: tuple[SampledToken, ...]  # the verifier's tokens for indices first, first+1, ...
    mismatch: bool  # the last token replaced a different candidate


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)


def _grammar_masks(request: Request, positions: list[int]) -> list[torch.Tensor | None] | None:
    """The grammar's mask for each drawn position from the first unverified one on (the same
    masks the fast path applied: each a function of the tokens before its position)."""
    if request.guide is None:
        return None
    prompt = len(request.prompt_token_ids)
    counts = [p - prompt if p >= request.num_verified else -1 for p in positions]
    return request.guide.masks_after(request.reply_ids, counts)


def _histories(request: Request, positions: list[int]) -> list[TokenHistory | None] | None:
    """What each drawn position's processors see: the tokens before it (the candidates before a
    taken position all matched, so they are the tokens the fast path drew it after)."""
    if not request.params.processes:
        return None
    prompt = request.prompt_token_ids
    return [TokenHistory(prompt, request.token_ids[len(prompt) : max(p, len(prompt))]) for p in positions]


class Verifier:
    def __init__(
        self,
        config: DeterministicConfig,
        model: HybridLM,
        caches: ModelCaches,
        coordinator: CacheCoordinator,
        banned_token_ids: torch.Tensor,
        eos_token_ids: frozenset[int],
    ):
        self.config = config
        self.tiles = TileModel(model, caches, config.ssd_chunk)
        self.caches = caches
        self.coordinator = coordinator
        self.banned = banned_token_ids
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back
        self.vocab = model.config.vocab_size
        self.d_conv = model.config.mamba.d_conv
        self.metrics = DeterministicMetrics()
        self._rng = random.Random(config.mismatch_seed)
        self._result: TileResult | None = None

    # -- the fast path's side ------------------------------------------------------------------
    def on_candidate(self, request: Request, token: SampledToken, ends: Callable[[Request, int], bool]) -> None:
        """A token decoded on the fast path: kept as an unverified candidate; the request
        waits for a verify pass when its tile is full or the candidate would end it."""
        token_id = token.token_id
        if self.config.mismatch_rate and self._rng.random() < self.config.mismatch_rate:
            token_id = (token_id + 1) % self.vocab  # fed back as if decoded: rollback must undo it
            self.metrics.injected_mismatches += 1
        request.token_ids.append(token_id)
        if request.num_computed_tokens % self.config.window == 0 or ends(request, token_id):
            request.verify_due = True

    # -- a verify pass --------------------------------------------------------------------------
    def verify(self, requests: list[Request]) -> list[Verdict]:
        """One pass over up to G requests (dummy rows fill the rest); commit() must follow."""
        cfg = self.config
        t = cfg.window
        jobs = [(r, r.aligned_len, self._end(r)) for r in requests[: cfg.rows]]
        start = time.perf_counter()
        with _threads(cfg.num_threads):
            self._result = self.tiles.forward(self._batch(jobs))
            verdicts = []
            for row, (request, tile_start, end) in enumerate(jobs):
                positions = list(range(tile_start + 1, tile_start + t + 1))
                drawn = sample(self._result.logits[row], [request.params] * t, positions, self.banned,
                               allowed=_grammar_masks(request, positions),
                               histories=_histories(request, positions), eos_token_ids=self.eos_token_ids)
                verdicts.append(self._walk(request, row, tile_start, end, drawn))
        self.metrics.passes += 1
        self.metrics.windows_verified += len(jobs)
        self.metrics.verify_seconds += time.perf_counter() - start
        return verdicts

    def _end(self, request: Request) -> int:
        end = min(request.aligned_len + self.config.window, request.num_tokens)
        covered = len(self.coordinator.block_table(request)) * self.coordinator.kv.block_size
        if end > covered:
            if self.coordinator.can_grow(request, end):
                self.coordinator.grow(request, end)
            else:  # the last candidate is compared instead of fed: still exact, one token less
                end = covered
        assert end > request.aligned_len, (request.request_id, end, request.aligned_len)
        return end

    def _batch(self, jobs: list[tuple[Request, int, int]]) -> TileBatch:
        g, t, bs = self.config.rows, self.config.window, self.coordinator.kv.block_size
        ids = torch.zeros(g, t, dtype=torch.long)
        positions = torch.arange(t)[None, :].repeat(g, 1)
        history = torch.zeros(g, dtype=torch.long)
        # The pages of each row's history [0, kT): the last may hold positions >= kT too
        # (when bs does not divide T); those are never read, and the null block pads.
        pages = max((-(-start // bs) for _, start, _ in jobs), default=0)
        tables = torch.zeros(g, pages, dtype=torch.long)
        conv0 = [torch.zeros(g, *c.shape[1:], dtype=c.dtype, device=c.device) for c in self.caches.conv]
        ssm0 = [torch.zeros(g, *s.shape[1:], dtype=s.dtype, device=s.device) for s in self.caches.ssm]
        for row, (request, start, end) in enumerate(jobs):
            ids[row, : end - start] = torch.tensor(request.token_ids[start:end])
            positions[row] += start
            history[row] = start // t
            own = -(-start // bs)
            tables[row, :own] = torch.tensor(self.coordinator.block_table(request)[:own], dtype=torch.long)
            slot = self.coordinator.aligned_slot(request)
            for dst, src in zip(conv0 + ssm0, self.caches.conv + self.caches.ssm):
                dst[row] = src[slot]
        device = self.tiles.device  # the index tensors are made on the host, then moved at once
        return TileBatch(ids.to(device), positions.to(device), tables.to(device), history.to(device), conv0, ssm0)

    def _walk(self, request: Request, row: int, start: int, end: int, drawn: list[SampledToken]) -> Verdict:
        first = request.num_verified
        assert first > start, (request.request_id, first, start)
        taken: list[SampledToken] = []
        mismatch = False
        for index in range(first, end + 1):
            token = drawn[index - start - 1]
            taken.append(token)
            if index < request.num_tokens and request.token_ids[index] == token.token_id:
                continue
            mismatch = index < request.num_tokens
            if mismatch:
                self.metrics.rollbacks += 1
                self.metrics.tokens_redone += request.num_tokens - index
            break
        self.metrics.tokens_verified += len(taken)
        return Verdict(request, row, start, end, first, tuple(taken), mismatch)

    # -- commit -----------------------------------------------------------------------------------
    def commit(self, verdicts: list[Verdict], kept: list[int]) -> None:
        """Write the verified state: `kept[i]` of verdict i's tokens survived the stop checks
        (the engine has already put them in token_ids)."""
        result, self._result = self._result, None
        assert result is not None, "commit without a pass"
        start_time = time.perf_counter()
        lengths = torch.zeros(self.config.rows, dtype=torch.long)
        for verdict, n in zip(verdicts, kept):
            request, start = verdict.request, verdict.tile_start
            done = verdict.first + n - 1 if n else verdict.end  # positions [0, done) are committed
            lengths[verdict.row] = done - start
            self._write_kv(request, result, verdict.row, start, done)
            request.num_computed_tokens = done
            request.num_verified = request.num_tokens
            request.tile_window = self.config.window
            # Still due: a prompt spanning further tiles (or no fast decode at all). A
            # prefill-only request ends without a fast step, so its tiles must cover the
            # whole prompt: with P = kT + 1 its last token would otherwise run on the fast
            # path and the head would hold fast-path state at kT.
            target = request.num_tokens if request.prefill_only else request.num_tokens - 1
            request.verify_due = done < target or not self.config.fast_decode
        with _threads(self.config.num_threads):
            states = [state_at(scan, lengths.to(self.tiles.device), self.d_conv) for scan in result.scans]
        for verdict in verdicts:
            request, row = verdict.request, verdict.row
            slots = [self.coordinator.state_slot(request)]
            if request.num_computed_tokens == verdict.tile_start + self.config.window:
                slots.append(self.coordinator.aligned_slot(request))
                request.aligned_len = request.num_computed_tokens
            for layer, (conv, ssm) in enumerate(states):
                for slot in slots:
                    self.caches.conv[layer][slot] = conv[row]
                    self.caches.ssm[layer][slot] = ssm[row]
        self.metrics.verify_seconds += time.perf_counter() - start_time

    def _write_kv(self, request: Request, result: TileResult, row: int, start: int, done: int) -> None:
        """K/V of positions [start, done) from the tile, except into blocks shared with a
        committed head (those already hold the head's bits and are never written)."""
        bs = self.coordinator.kv.block_size
        table = self.coordinator.block_table(request)
        refs = self.coordinator.kv.pool.ref_counts
        positions = [p for p in range(start, done) if refs[table[p // bs]] == 1]
        if not positions:
            return
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in positions], device=self.tiles.device)
        rows = torch.tensor([p - start for p in positions], device=self.tiles.device)
        for kv, keys, values in zip(self.caches.kv, result.keys, result.values):
            kv[0].view(-1, *kv.shape[3:])[slots] = keys[row, rows].to(kv.dtype)
            kv[1].view(-1, *kv.shape[3:])[slots] = values[row, rows].to(kv.dtype)
