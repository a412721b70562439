"""Fast paths against slow ones: chunked prefill == one-shot prefill, and prefill N then
decode k == prefill N + k, at the model level (explicit chunk splits through the runner)
and at the engine level (a small per-step token budget forces the scheduler to chunk).

Tiny presets: KV block size 16 in the engine, Mamba chunk size 16.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import (
    GREEDY,
    LogitRecorder,
    assert_logits_close,
    hf_logits,
    new_engine,
    our_logits,
    prompt_of,
    run_engine,
)
from tests.families import ARCHS


# Splits of a 50-token prompt; block size 16 / Mamba chunk 16 boundaries at 16, 32, 48.
SPLITS = [
    [50],
    [16, 16, 16, 2],  # aligned with blocks and Mamba chunks
    [7, 9, 1, 15, 18],  # ends exactly on 16, a 1-token chunk at 16 (decode path), crosses 32
    [15, 2, 30, 3],  # straddles 16 and 32..48
    [1, 1, 1, 47],  # a chunk of one token at position 0, then single-token steps
    [33, 17],
]


@ARCHS
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_chunked_prefill_equals_one_shot(tiny, arch, split):
    model = tiny[arch].ours
    ids = prompt_of(50, seed=9)
    assert_logits_close(our_logits(model, ids, split), our_logits(model, ids))


@ARCHS
def test_chunked_prefill_equals_one_shot_small_blocks(tiny, arch):
    """Block size 5: chunks split KV blocks at every possible offset."""
    model = tiny[arch].ours
    ids = prompt_of(41, seed=3)
    one_shot = our_logits(model, ids, block_size=5)
    assert_logits_close(our_logits(model, ids, [3, 4, 6, 11, 2, 15], block_size=5), one_shot)
    assert_logits_close(one_shot, hf_logits(tiny[arch], ids))


@ARCHS
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31])
def test_prefill_then_decode_equals_longer_prefill(tiny, arch, n):
    model = tiny[arch].ours
    k = 6
    ids = prompt_of(n + k, seed=n)
    decoded = our_logits(model, ids, [n] + [1] * k)
    assert_logits_close(decoded[n - 1 :], our_logits(model, ids)[n - 1 :])


def _generate(engine, prompts, params=GREEDY):
    recorder = LogitRecorder(engine)
    run = run_engine(engine, prompts, params)
    return run, recorder


@ARCHS
@pytest.mark.parametrize("budget", [1, 5, 16, 23])
def test_engine_chunked_prefill_equals_one_shot(tiny, arch, budget):
    prompts = {"a": prompt_of(50, seed=1), "b": prompt_of(33, seed=2), "c": prompt_of(16, seed=3)}
    ref_run, ref_logits = _generate(new_engine(tiny[arch].path), prompts)
    chunked = new_engine(tiny[arch].path, max_num_batched_tokens=budget)
    seen_sizes = set()
    inner = chunked.runner.build_batch

    def build_batch(chunks):
        seen_sizes.update((c.request.request_id, c.start, c.num_tokens) for c in chunks)
        return inner(chunks)

    chunked.runner.build_batch = build_batch
    run, logits = _generate(chunked, prompts)
    # The budget really split prompts, at offsets that are not block- or chunk-aligned.
    prefill_chunks = [s for s in seen_sizes if s[0] == "a" and s[1] < 50]
    assert len(prefill_chunks) >= -(-50 // budget)
    assert max(n for _, _, n in seen_sizes) <= budget
    for rid in prompts:
        assert run.tokens[rid] == ref_run.tokens[rid]
        assert_logits_close(logits.stacked(rid), ref_logits.stacked(rid))


@ARCHS
def test_engine_decode_equals_one_shot_prefill(tiny, arch):
    """Each decode step's logits == a one-shot prefill of prompt + tokens so far (our model)."""
    engine = new_engine(tiny[arch].path)
    prompt = prompt_of(14, seed=5)  # decode crosses the block boundary at 16
    run, logits = _generate(engine, {"a": prompt})
    full = prompt + run.tokens["a"]
    one_shot = our_logits(tiny[arch].ours, full[:-1])
    assert_logits_close(logits.stacked("a"), one_shot[len(prompt) - 1 :])
