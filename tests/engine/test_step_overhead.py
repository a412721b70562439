"""The decode step's bookkeeping fast paths, each against its slow reference:

- the incremental detokenizer == decoding the whole output every token (byte-level tokens that
  split UTF-8 characters, a decoder that strips the first token's leading space, skipped
  special tokens, stop strings spanning tokens);
- the pure decode batch built from one int64 buffer == the general batch builder;
- the scheduler's kept state slots and the tables it hands out == the cache coordinator's, at
  every step of a run that preempts and re-admits requests;
- one argmax for an all-greedy batch == the per-row sampler, masking in place only when asked.
"""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.engine.conftest import kv_bytes_for_blocks, new_engine, prompt_of, run_engine
from workers.checkpoint import Arch
from workers.detokenizer import Detokenizer, FullDecodeDetokenizer
from workers.sampling import SamplingParams, sample
from workers.tokenizer import ChatTokenizer


# -- detokenizer -----------------------------------------------------------------------------------
def _byte_level(out_dir) -> ChatTokenizer:
    """One token per byte (GPT-2 byte-level alphabet, no merges) plus two special tokens: a
    multibyte character always spans several tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)  # fmt: skip
    fast.save_pretrained(out_dir)
    return ChatTokenizer(out_dir)


def _metaspace(out_dir) -> ChatTokenizer:
    """Word pieces with a leading "▁" that the decoder turns into a space, except on the first
    token it sees: a window decode that started at the wrong token would lose or add a space."""
    words = ["▁Hello", "▁world", "!", "▁a", "b", "▁c", "d"]
    vocab = {w: i for i, w in enumerate(["<unk>"] + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)  # fmt: skip
    fast.save_pretrained(out_dir)
    return ChatTokenizer(out_dir)


def _stream(detok, ids: list[int]) -> list[tuple[str, bool]]:
    out = []
    for token in ids:
        delta, stopped = detok.update(token)
        out.append((delta, stopped))
        if stopped:
            return out
    out.append((detok.flush(), False))
    return out


def _utf8_ids(tok: ChatTokenizer, text: str) -> list[int]:
    return tok.encode(text)


@pytest.mark.parametrize("stop", [(), ("é!",), ("😀", "ab c")], ids=["no-stop", "stop-2", "stops"])
def test_incremental_detokenizer_equals_full_decode_on_split_characters(tmp_path, stop):
    tok = _byte_level(tmp_path)
    assert tok._backend is not None  # the plain backend decode is the one under test
    texts = ["héllo wörld! 😀 ab cd", "日本語のテキスト é!", "😀😀é!😀", "plain ascii only"]
    cases = [_utf8_ids(tok, t) for t in texts]
    specials = tok._tok.convert_tokens_to_ids(["<eos>", "<pad>"])
    rng = random.Random(0)
    for _ in range(40):  # random bytes: invalid sequences, cut characters, special tokens between
        ids = [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
        cases.append([rng.choice(specials) if rng.random() < 0.1 else t for t in ids])
    for ids in cases:
        incremental = _stream(Detokenizer(tok, stop), ids)
        assert incremental == _stream(FullDecodeDetokenizer(tok, stop), ids), ids
        if not any(s for _, s in incremental):  # the deltas add up to the whole text
            assert "".join(d for d, _ in incremental) == tok.decode(ids)


def test_incremental_detokenizer_equals_full_decode_with_a_leading_space_decoder(tmp_path):
    tok = _metaspace(tmp_path)
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(1, 8) for _ in range(rng.randrange(1, 12))]
        for stop in ((), ("d ",), ("world!",)):
            assert _stream(Detokenizer(tok, stop), ids) == _stream(FullDecodeDetokenizer(tok, stop), ids), (ids, stop)


def test_a_split_character_is_held_back_until_complete(tmp_path):
    tok = _byte_level(tmp_path)
    ids = _utf8_ids(tok, "a😀")  # 1 + 4 bytes
    detok = Detokenizer(tok, ())
    deltas = [detok.update(t)[0] for t in ids]
    assert deltas == ["a", "", "", "", "😀"]


# -- the pure decode batch -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", [Arch.GRANITEMOEHYBRID, Arch.NEMOTRON_H])
def test_decode_batch_equals_the_general_batch(tiny, arch):
    engine = new_engine(tiny[arch].path, block_size=4)
    lengths = [3, 9, 17, 4, 12]  # different table widths; odd lengths keep slots non-contiguous
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", prompt_of(n, seed=i), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefills
    engine.abort("r1")  # a hole in the slots
    step = engine.scheduler.schedule()
    assert all(c.num_tokens == 1 for c in step.chunks) and len(step.chunks) == 4
    fast, rows = engine.runner.build_batch(step.chunks)
    ref, ref_rows = engine.runner._mixed_batch(step.chunks)
    assert rows is None and ref_rows is None
    for name in ("input_ids", "positions", "kv_slots"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert fast.prefills == ref.prefills == ()
    a, b = fast.decode, ref.decode
    for name in ("token_index", "context_lens", "block_tables", "state_slots", "num_keys"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.slot_run, a.covers_batch, a.snapshot_rows, a.snapshot_slots) == (
        b.slot_run, b.covers_batch, b.snapshot_rows, b.snapshot_slots)  # fmt: skip
    engine.scheduler.advance(step)  # the step ran (as far as the counters go); finish cleanly
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)


# -- the scheduler's kept slots --------------------------------------------------------------------
@pytest.mark.parametrize("arch", [Arch.GRANITEMOEHYBRID, Arch.NEMOTRON_H])
def test_scheduled_slots_and_tables_are_the_coordinators_through_preemption(tiny, arch):
    path = tiny[arch].path
    engine = new_engine(path, block_size=4, kv_cache_bytes=kv_bytes_for_blocks(path, 12, 4), num_state_slots=3,
                        max_num_batched_tokens=6)  # fmt: skip
    inner, checked = engine.scheduler.schedule, []

    def schedule():
        out = inner()
        for chunk in out.chunks:
            assert chunk.state_slot == engine.caches.state_slot(chunk.request)
            assert chunk.block_table == engine.caches.block_table(chunk.request)
            checked.append(chunk.request.num_preemptions)
        return out

    engine.scheduler.schedule = schedule
    prompts = {f"r{i}": prompt_of(n, seed=10 + i) for i, n in enumerate([18, 9, 25, 4])}
    run = run_engine(engine, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert run.preempted and any(n > 0 for n in checked), "re-admitted requests must have been scheduled"
    assert not engine.has_unfinished()
    engine.check_integrity()  # includes: no state slots remembered for requests that left


# -- sampling -------------------------------------------------------------------------------------
def test_all_greedy_batch_equals_the_per_row_sampler_and_masks_in_place_only_when_asked():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 40, generator=g)
    banned = torch.tensor([int(i) for i in logits.argmax(-1)[:3]])  # the best ids of 3 rows are banned
    greedy = [SamplingParams(temperature=0.0)] * 7
    with_logprobs = [SamplingParams(temperature=0.0, logprobs=0)] * 7  # the per-row path
    kept = logits.clone()
    fast = sample(logits, greedy, list(range(7)), banned)
    assert torch.equal(logits, kept), "sample must not write the caller's logits unless told"
    slow = sample(logits, with_logprobs, list(range(7)), banned)
    assert [t.token_id for t in fast] == [t.token_id for t in slow]
    assert not set(t.token_id for t in fast) & set(banned.tolist())
    assert all(t.logprob is None and t.top_logprobs is None for t in fast)
    again = sample(logits, greedy, list(range(7)), banned, overwrite=True)
    assert [t.token_id for t in again] == [t.token_id for t in fast]
    assert torch.isinf(logits[:, banned]).all()
