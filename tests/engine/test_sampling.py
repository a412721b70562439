"""Sampling: seeded draws are a pure function of (seed, position, logits); top-k 1 is greedy;
logprobs are log_softmax of the model's logits; stop strings, stop tokens, EOS and
max_tokens end a request with the right reason and text.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.engine.conftest import GREEDY, hf_logits, new_engine, prompt_of, run_engine
from workers.checkpoint import EOS_TOKEN_ID, NEVER_SAMPLE_TOKEN_IDS, Arch
from workers.request import FinishReason
from workers.sampling import SamplingParams, sample

PROMPT = prompt_of(19, seed=8)


@pytest.fixture(scope="module")
def ckpt(tiny):
    return tiny[Arch.GRANITEMOEHYBRID]


@pytest.fixture(scope="module")
def greedy_tokens(ckpt):
    return run_engine(new_engine(ckpt.path), {"g": PROMPT}, SamplingParams(max_tokens=24, temperature=0.0,
                                                                            ignore_eos=True)).tokens["g"]


def _seeded(seed, **kw):
    return SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True, **kw)


# -- the sampler as a pure function ----------------------------------------------------------
def test_draw_is_a_pure_function_of_seed_position_and_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 2
    params = [_seeded(s) for s in (1, 2, 3, 1, 1, 2)]
    positions = [10, 10, 10, 10, 11, 10]
    batched = [t.token_id for t in sample(logits, params, positions)]
    alone = [sample(logits[i : i + 1], [params[i]], [positions[i]])[0].token_id for i in range(6)]
    assert batched == alone
    again = [t.token_id for t in sample(logits.flip(0), params[::-1], positions[::-1])][::-1]
    assert again == batched
    # Same (seed, position, logits) -> same token, across rows of one batch.
    same = sample(logits[[0, 0, 0]], [_seeded(1)] * 3, [10, 10, 10])
    assert len({t.token_id for t in same}) == 1


def test_draws_vary_with_seed_and_position():
    logits = torch.zeros(1, 40)  # uniform: every draw is the random number itself
    by_position = {sample(logits, [_seeded(5)], [p])[0].token_id for p in range(60)}
    by_seed = {sample(logits, [_seeded(s)], [7])[0].token_id for s in range(60)}
    assert len(by_position) > 20 and len(by_seed) > 20


def test_sample_frequencies_follow_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    n = 1500
    counts = torch.zeros(4)
    for p in range(n):
        counts[sample(logits, [_seeded(99)], [p])[0].token_id] += 1
    assert torch.allclose(counts / n, torch.softmax(logits[0], -1), atol=0.04)
    # temperature 0.5 sharpens the same distribution
    counts.zero_()
    for p in range(n):
        counts[sample(logits, [SamplingParams(temperature=0.5, seed=99)], [p])[0].token_id] += 1
    assert torch.allclose(counts / n, torch.softmax(logits[0] / 0.5, -1), atol=0.04)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0]])
    top_k = {sample(logits, [_seeded(1, top_k=2)], [p])[0].token_id for p in range(300)}
    assert top_k == {0, 1}
    probs = torch.softmax(logits[0], -1)  # [0.43, 0.26, 0.16, ...]: 0.5 keeps tokens 0 and 1
    assert probs[0] < 0.5 < probs[0] + probs[1]
    top_p = {sample(logits, [_seeded(1, top_p=0.5)], [p])[0].token_id for p in range(300)}
    assert top_p == {0, 1}
    assert {sample(logits, [_seeded(1, top_k=1)], [p])[0].token_id for p in range(50)} == {0}


def test_min_p_keeps_the_tokens_at_least_that_fraction_of_the_likeliest():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0]])
    probs = torch.softmax(logits[0], -1)  # relative to the first: 1, 0.61, 0.37, 0.14, ...
    assert probs[2] < 0.4 * probs[0] < probs[1]
    kept = {sample(logits, [_seeded(1, min_p=0.4)], [p])[0].token_id for p in range(300)}
    assert kept == {0, 1}
    assert {sample(logits, [_seeded(1, min_p=1.0)], [p])[0].token_id for p in range(50)} == {0}
    assert len({sample(logits, [_seeded(1, min_p=0.0)], [p])[0].token_id for p in range(300)}) == 6


def test_banned_ids_are_never_sampled():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 50.0  # the model's favourite is banned
    banned = torch.tensor([3, 4])
    greedy = sample(logits, [SamplingParams(temperature=0.0)], [0], banned)[0].token_id
    hot = {sample(logits, [SamplingParams(temperature=100.0, seed=1)], [p], banned)[0].token_id for p in range(200)}
    assert greedy not in (3, 4) and not hot & {3, 4}


# -- seeded sampling in the engine --------------------------------------------------------------
def test_same_seed_same_tokens_alone_or_batched(ckpt):
    alone = run_engine(new_engine(ckpt.path), {"x": PROMPT}, _seeded(123)).tokens["x"]
    prompts = {"x": PROMPT, **{f"o{i}": prompt_of(5 + 9 * i, seed=i) for i in range(5)}}
    params = {"x": _seeded(123), **{f"o{i}": _seeded(i) for i in range(5)}}
    batched = run_engine(new_engine(ckpt.path, max_num_batched_tokens=13), prompts, params).tokens
    assert batched["x"] == alone
    again = run_engine(new_engine(ckpt.path), {"x": PROMPT}, _seeded(123)).tokens["x"]
    assert again == alone


def test_different_seeds_give_different_tokens(ckpt):
    engine = new_engine(ckpt.path)
    outs = run_engine(engine, {f"s{s}": PROMPT for s in range(4)}, {f"s{s}": _seeded(s) for s in range(4)}).tokens
    assert len({tuple(t) for t in outs.values()}) == 4


def test_unseeded_requests_get_independent_seeds(ckpt):
    """seed=None: each request draws its own randomness, even when callers share one
    SamplingParams object (as LLMEngine.generate does for all its prompts)."""
    engine = new_engine(ckpt.path)
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    outs = run_engine(engine, {"a": PROMPT, "b": PROMPT}, params).tokens
    assert outs["a"] != outs["b"]


def test_top_k_1_equals_greedy(ckpt, greedy_tokens):
    params = SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    assert run_engine(new_engine(ckpt.path), {"k": PROMPT}, params).tokens["k"] == greedy_tokens


def test_tiny_top_p_equals_greedy(ckpt, greedy_tokens):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
    assert run_engine(new_engine(ckpt.path), {"p": PROMPT}, params).tokens["p"] == greedy_tokens


# -- logprobs ----------------------------------------------------------------------------------
def _reference_logprobs(ckpt, prompt, tokens):
    logits = hf_logits(ckpt, prompt + tokens[:-1])[len(prompt) - 1 :]
    logits[:, list(NEVER_SAMPLE_TOKEN_IDS)] = -torch.inf  # the engine never samples these
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, temperature=0.0, logprobs=5, ignore_eos=True),
                                    SamplingParams(max_tokens=10, temperature=0.7, seed=5, logprobs=3,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_logprobs_are_log_softmax_of_the_model(ckpt, params):
    run = run_engine(new_engine(ckpt.path), {"l": PROMPT}, params)
    sampled = [t for out in run.outputs["l"] for t in out.new_tokens]
    ref = _reference_logprobs(ckpt, PROMPT, [t.token_id for t in sampled])
    for row, token in zip(ref, sampled):
        assert abs(token.logprob - float(row[token.token_id])) <= 1e-4
        assert len(token.top_logprobs) == params.logprobs
        values = [v for _, v in token.top_logprobs]
        assert values == sorted(values, reverse=True)
        ref_values, ref_ids = torch.topk(row, params.logprobs)
        assert [i for i, _ in token.top_logprobs] == ref_ids.tolist()
        assert torch.allclose(torch.tensor(values, dtype=torch.float32), ref_values, atol=1e-4)
        if params.greedy:
            assert token.top_logprobs[0][0] == token.token_id
    if not params.greedy:  # sampled, not argmax, at least once in 10 draws at temperature 0.7
        assert any(t.top_logprobs[0][0] != t.token_id for t in sampled)


def test_logprobs_zero_and_none(ckpt):
    zero = run_engine(new_engine(ckpt.path), {"z": PROMPT}, SamplingParams(max_tokens=3, temperature=0.0, logprobs=0))
    none = run_engine(new_engine(ckpt.path), {"n": PROMPT}, SamplingParams(max_tokens=3, temperature=0.0))
    for out in zero.outputs["z"]:
        for t in out.new_tokens:
            assert t.logprob is not None and t.logprob <= 0 and t.top_logprobs == ()
    for out in none.outputs["n"]:
        for t in out.new_tokens:
            assert t.logprob is None and t.top_logprobs is None


# -- how requests end -----------------------------------------------------------------------------
def test_max_tokens_finishes_with_length(ckpt, greedy_tokens):
    run = run_engine(new_engine(ckpt.path), {"m": PROMPT}, SamplingParams(max_tokens=5, temperature=0.0,
                                                                            ignore_eos=True))
    assert run.tokens["m"] == greedy_tokens[:5]
    assert run.requests["m"].finish_reason is FinishReason.LENGTH
    assert [o.finished for o in run.outputs["m"]] == [False] * 4 + [True]


def test_stop_strings(ckpt, greedy_tokens):
    engine = new_engine(ckpt.path)
    full = engine.tokenizer.decode(greedy_tokens)
    stop = full[9:11]  # two characters: completes over two tokens
    cut = full.find(stop)
    completing = next(k for k in range(1, len(greedy_tokens) + 1) if stop in engine.tokenizer.decode(greedy_tokens[:k]))
    run = run_engine(engine, {"s": PROMPT}, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                           stop=(stop, "never-in-output-~~~")))
    assert run.requests["s"].finish_reason is FinishReason.STOP
    assert run.text["s"] == full[:cut]
    assert stop not in run.text["s"]
    assert run.tokens["s"] == greedy_tokens[:completing]  # generation ends at the completing token
    streamed = [o.text_delta for o in run.outputs["s"]]
    assert "".join(streamed) == full[:cut]


def test_include_stop_str_in_output_ends_the_reply_with_the_matched_stop_string(ckpt, greedy_tokens):
    """vLLM's field: the same tokens as without it, the text cut after the stop string, not before."""
    engine = new_engine(ckpt.path)
    full = engine.tokenizer.decode(greedy_tokens)
    stop = full[9:11]
    cut = full.find(stop)
    params = dict(max_tokens=24, temperature=0.0, ignore_eos=True, stop=("never-in-output-~~~", stop))
    without = run_engine(engine, {"s": PROMPT}, SamplingParams(**params))
    run = run_engine(engine, {"s": PROMPT}, SamplingParams(**params, include_stop_str_in_output=True))
    assert run.requests["s"].finish_reason is FinishReason.STOP
    assert run.text["s"] == full[: cut + len(stop)] and run.text["s"].endswith(stop)
    assert "".join(o.text_delta for o in run.outputs["s"]) == run.text["s"]
    assert run.tokens["s"] == without.tokens["s"]  # it changes the text, never where generation ends


def test_earliest_stop_string_wins_and_absent_ones_do_nothing(ckpt, greedy_tokens):
    engine = new_engine(ckpt.path)
    full = engine.tokenizer.decode(greedy_tokens)
    late, early = full[15:18], full[4:6]
    run = run_engine(engine, {"s": PROMPT}, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                           stop=(late, early)))
    assert run.text["s"] == full[: min(full.find(late), full.find(early))]
    absent = run_engine(engine, {"a": PROMPT}, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                              stop=("\x01never",)))
    assert absent.text["a"] == full and absent.requests["a"].finish_reason is FinishReason.LENGTH


def _first_new(tokens, start=3):
    """An index i >= start whose token does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_finish_with_stop(ckpt, greedy_tokens):
    i = _first_new(greedy_tokens)
    run = run_engine(new_engine(ckpt.path), {"t": PROMPT}, SamplingParams(max_tokens=24, temperature=0.0,
                                                                            stop_token_ids=(greedy_tokens[i],)))
    assert run.tokens["t"] == greedy_tokens[: i + 1]
    assert run.requests["t"].finish_reason is FinishReason.STOP


def test_eos_finishes_with_stop_unless_ignored(ckpt, greedy_tokens, tmp_path):
    """Make a token the model emits greedily an EOS of the checkpoint (config.json)."""
    i = _first_new(greedy_tokens)
    path = tmp_path / "eos"
    shutil.copytree(ckpt.path, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = [EOS_TOKEN_ID, greedy_tokens[i]]
    (path / "config.json").write_text(json.dumps(config))
    engine = new_engine(path)
    assert {EOS_TOKEN_ID, greedy_tokens[i]} <= engine.eos_token_ids
    run = run_engine(engine, {"e": PROMPT}, SamplingParams(max_tokens=24, temperature=0.0))
    assert run.tokens["e"] == greedy_tokens[: i + 1]
    assert run.requests["e"].finish_reason is FinishReason.STOP
    ignored = run_engine(engine, {"i": PROMPT}, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert ignored.tokens["i"] == greedy_tokens
    assert ignored.requests["i"].finish_reason is FinishReason.LENGTH


def test_natural_eos_token(tiny):
    """The tiny Bamba emits <|end_of_turn|> greedily after this prompt: the request stops there."""
    ckpt = tiny[Arch.BAMBA]
    prompt = list(range(10, 40))
    free_run = run_engine(new_engine(ckpt.path), {"f": prompt}, SamplingParams(max_tokens=30, temperature=0.0,
                                                                               ignore_eos=True)).tokens["f"]
    if EOS_TOKEN_ID not in free_run:
        pytest.skip("this checkpoint does not emit EOS greedily for the prompt")
    run = run_engine(new_engine(ckpt.path), {"e": prompt}, SamplingParams(max_tokens=30, temperature=0.0))
    assert run.tokens["e"] == free_run[: free_run.index(EOS_TOKEN_ID) + 1]
    assert run.requests["e"].finish_reason is FinishReason.STOP
    assert run.text["e"] == ""  or "<|" not in run.text["e"]
