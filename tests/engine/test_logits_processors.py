"""The logits processors (presence, frequency and repetition penalties, logit_bias, min_tokens):
their logits computed by hand on small examples, rows that ask for none untouched, and the
engine's replies checked against a slow reference that applies them by hand to the model's
logits step by step.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import hf_logits, new_engine, prompt_of, run_engine
from workers.checkpoint import EOS_TOKEN_ID, NEVER_SAMPLE_TOKEN_IDS, Arch
from workers.errors import InvalidRequestError
from workers.logits_processors import TokenHistory, apply_processors
from workers.request import FinishReason
from workers.sampling import SamplingParams, sample

PROMPT = prompt_of(19, seed=8)
LOGITS = [1.0, -2.0, 3.0, 0.5, -0.5, 2.5]
EOS = frozenset({5})


def _processed(params: SamplingParams, prompt=(1, 3), output=(2, 2, 0), logits=LOGITS, allowed=None):
    x = torch.tensor([logits])
    apply_processors(x, [params], [TokenHistory(list(prompt), list(output))], EOS, allowed)
    return x[0].tolist()


# -- each processor by hand ----------------------------------------------------------------------
def test_presence_and_frequency_penalties_count_the_output_only():
    # output (2, 2, 0): token 2 twice, token 0 once; the prompt's tokens 1 and 3 are not counted
    got = _processed(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert got == pytest.approx([1.0 - 0.5 - 0.25, -2.0, 3.0 - 0.5 - 2 * 0.25, 0.5, -0.5, 2.5])
    negative = _processed(SamplingParams(presence_penalty=-1.0, frequency_penalty=-2.0))
    assert negative == pytest.approx([1.0 + 1 + 2, -2.0, 3.0 + 1 + 4, 0.5, -0.5, 2.5])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    got = _processed(SamplingParams(repetition_penalty=2.0), prompt=(1, 3), output=(2, 4))
    # seen: 1 (-2.0 -> -4.0), 3 (0.5 -> 0.25), 2 (3.0 -> 1.5), 4 (-0.5 -> -1.0); 0 and 5 unseen
    assert got == pytest.approx([1.0, -4.0, 1.5, 0.25, -1.0, 2.5])
    below_one = _processed(SamplingParams(repetition_penalty=0.5), prompt=(0,), output=())
    assert below_one == pytest.approx([2.0, *LOGITS[1:]])


def test_penalties_apply_after_the_bias_as_vllm_orders_them():
    params = SamplingParams(logit_bias={1: 3.0, 4: -1.0}, repetition_penalty=2.0, frequency_penalty=1.0)
    got = _processed(params, prompt=(1,), output=(4,))
    # 1: -2 + 3 = 1 (seen in the prompt) -> 0.5; 4: -0.5 - 1 = -1.5 (seen) -> -3.0, minus 1 x count 1
    assert got == pytest.approx([1.0, 0.5, 3.0, 0.5, -4.0, 2.5])


def test_min_tokens_holds_back_eos_and_stop_token_ids_until_reached():
    params = SamplingParams(min_tokens=3, stop_token_ids=(0,), max_tokens=8)
    held = _processed(params, output=(2, 2))
    assert held[0] == held[5] == -torch.inf and held[1:5] == LOGITS[1:5]
    assert _processed(params, output=(2, 2, 2)) == LOGITS  # three generated: nothing held back
    ignoring_eos = _processed(SamplingParams(min_tokens=3, stop_token_ids=(0,), ignore_eos=True), output=())
    assert ignoring_eos[0] == -torch.inf and ignoring_eos[5] == 2.5


def test_min_tokens_gives_way_to_a_grammar_that_allows_only_the_end():
    only_eos = torch.zeros(len(LOGITS), dtype=torch.bool)
    only_eos[5] = True
    logits = [-torch.inf] * 5 + [2.5]  # the grammar's mask, already applied
    got = _processed(SamplingParams(min_tokens=3), output=(), logits=logits, allowed=[only_eos])
    assert got == logits


# -- through sample() ------------------------------------------------------------------------------
def test_greedy_rows_draw_the_argmax_of_the_processed_logits():
    logits = torch.tensor([LOGITS, LOGITS, LOGITS])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={3: 10.0}),
              SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    histories = [None, TokenHistory([], []), TokenHistory([1], [2, 2])]
    tokens = [t.token_id for t in sample(logits, params, [0, 0, 0], histories=histories)]
    assert tokens == [2, 3, 5]  # 3.0 - 2 x 1.0 = 1.0 < 2.5: token 5 now leads


def test_rows_that_ask_for_nothing_are_untouched_and_a_row_is_the_same_alone_or_batched():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    kept = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=4, presence_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0, repetition_penalty=1.7),
              SamplingParams(temperature=0.7, seed=1, logit_bias={7: -50.0, 9: 20.0})]
    histories = [None, TokenHistory([3, 4], [5, 5, 6]), None, TokenHistory([8], [9, 10]), TokenHistory([], [])]
    batched = [t.token_id for t in sample(logits, params, [4] * 5, histories=histories)]
    assert torch.equal(logits, kept)  # the caller's logits are copied, not changed
    alone = [sample(logits[i : i + 1], [params[i]], [4], histories=[histories[i]])[0].token_id for i in range(5)]
    assert batched == alone
    assert batched[0] == int(logits[0].argmax()) and batched[2] == int(logits[2].argmax()) and batched[4] == 9
    x = logits.clone()
    apply_processors(x, params, histories, frozenset())
    assert torch.equal(x[[0, 2]], kept[[0, 2]]) and not torch.equal(x[[1, 3, 4]], kept[[1, 3, 4]])


def test_logprobs_are_the_models_before_the_processors():
    logits = torch.tensor([LOGITS])
    params = SamplingParams(temperature=0.0, logprobs=1, logit_bias={0: 5.0})
    token = sample(logits, [params], [0], histories=[TokenHistory([], [])])[0]
    assert token.token_id == 0  # 1 + 5 leads
    assert token.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))


# -- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0.0),
    ("repetition_penalty", float("inf")), ("logit_bias", {1: 100.5}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {1: "x"}), ("min_tokens", 17), ("min_tokens", -1), ("presence_penalty", "1"),
])
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(max_tokens=16, **{field: value})


# -- in the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tiny):
    return tiny[Arch.GRANITEMOEHYBRID]


def _reference(ckpt, params: SamplingParams, steps: int, eos=frozenset({EOS_TOKEN_ID})) -> list[int]:
    """Greedy decoding with the processors applied by hand to transformers' logits."""
    out: list[int] = []
    for _ in range(steps):
        logits = hf_logits(ckpt, PROMPT + out)[-1:].clone()
        logits[:, list(NEVER_SAMPLE_TOKEN_IDS)] = -torch.inf
        apply_processors(logits, [params], [TokenHistory(PROMPT, out)], eos)
        out.append(int(logits[0].argmax()))
    return out


def test_a_strong_frequency_penalty_changes_a_greedy_reply_that_repeats(ckpt):
    engine = new_engine(ckpt.path)
    plain = run_engine(engine, {"p": PROMPT}, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert len(set(plain.tokens["p"])) < 32  # the tiny model repeats itself
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
                            presence_penalty=0.5, repetition_penalty=1.3)
    penalized = run_engine(engine, {"f": PROMPT}, params).tokens["f"]
    assert penalized != plain.tokens["p"]
    assert penalized == _reference(ckpt, params, 32)


def test_logit_bias_moves_the_first_greedy_token(ckpt):
    engine = new_engine(ckpt.path)
    first = run_engine(engine, {"g": PROMPT}, SamplingParams(max_tokens=1, temperature=0.0)).tokens["g"][0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={first: -100.0, 17: 4.0})
    biased = run_engine(engine, {"b": PROMPT}, params).tokens["b"]
    assert biased[0] != first and biased == _reference(ckpt, params, 4)
    forced = run_engine(engine, {"f": PROMPT}, SamplingParams(max_tokens=3, temperature=0.0, logit_bias={17: 100.0}))
    assert forced.tokens["f"] == [17, 17, 17]


def test_logit_bias_outside_the_vocabulary_is_refused(ckpt):
    engine = new_engine(ckpt.path)
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request("x", PROMPT, SamplingParams(logit_bias={vocab: 1.0}))


def test_min_tokens_holds_back_a_stop_token_id_and_eos(ckpt):
    engine = new_engine(ckpt.path)
    greedy = run_engine(engine, {"g": PROMPT}, SamplingParams(max_tokens=12, temperature=0.0,
                                                              ignore_eos=True)).tokens["g"]
    stop = greedy[1]
    stopped = run_engine(engine, {"s": PROMPT}, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,)))
    assert stopped.tokens["s"] == greedy[: greedy.index(stop) + 1]
    assert stopped.requests["s"].finish_reason is FinishReason.STOP
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,), min_tokens=6)
    held = run_engine(engine, {"m": PROMPT}, params)
    tokens = held.tokens["m"]
    assert len(tokens) >= 6 and stop not in tokens[:6] and EOS_TOKEN_ID not in tokens[:6]
    assert tokens[:6] == _reference(ckpt, params, 6, frozenset({EOS_TOKEN_ID}) | engine.eos_token_ids)
    # EOS itself: a reply forced towards it ends at once, unless min_tokens holds it back
    to_eos = dict(max_tokens=8, temperature=0.0, logit_bias={EOS_TOKEN_ID: 100.0})
    assert run_engine(engine, {"e": PROMPT}, SamplingParams(**to_eos)).tokens["e"] == [EOS_TOKEN_ID]
    late = run_engine(engine, {"l": PROMPT}, SamplingParams(**to_eos, min_tokens=3))
    assert late.tokens["l"][3] == EOS_TOKEN_ID and len(late.tokens["l"]) == 4
    assert EOS_TOKEN_ID not in late.tokens["l"][:3] and late.requests["l"].finish_reason is FinishReason.STOP


def test_min_tokens_defers_stop_strings(ckpt):
    engine = new_engine(ckpt.path)
    greedy = run_engine(engine, {"g": PROMPT}, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    full = greedy.text["g"]
    first_tokens = engine.tokenizer.decode(greedy.tokens["g"][:2])
    stop = first_tokens[-1:]  # completes in the first two tokens' text
    assert stop and full.find(stop) < len(first_tokens)
    early = run_engine(engine, {"e": PROMPT}, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                             stop=(stop,)))
    assert len(early.tokens["e"]) <= 2
    late = run_engine(engine, {"l": PROMPT}, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                            stop=(stop,), min_tokens=8))
    tokens = late.tokens["l"]
    assert len(tokens) > 8 and tokens == greedy.tokens["g"][: len(tokens)]
    # it ends at the first stop string completing in the text of a token after the 8th (vLLM's rule)
    cut = full.find(stop, len(engine.tokenizer.decode(tokens[:8])) - len(stop) + 1)
    if cut < 0:
        assert len(tokens) == 16 and late.text["l"] == full
    else:
        assert late.text["l"] == full[:cut] and late.requests["l"].finish_reason is FinishReason.STOP
