"""n > 1 (workers/loop/forks.py): n replies of one request from one prefill. The prompt runs
once (the scheduler's token count), and each choice is what a single request with the same
seed (choice i: seed + i) or greedy gives."""

from __future__ import annotations

import pytest

from tests.engine.conftest import new_engine, prompt_of
from tests.families import ARCHS
from workers.errors import InvalidRequestError
from workers.sampling import MAX_CHOICES, SamplingParams

PROMPT_LEN = 37  # not a multiple of the block size (16): the tail block is copied on fork


def run_group(engine, request_id, prompt, params):
    """Step a request of n choices to its end: {choice index: token ids}, and its outputs."""
    engine.add_request(request_id, prompt, params)
    tokens, outputs = {i: [] for i in range(params.n)}, []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            assert out.stream_id == request_id and out.choices == params.n
            tokens[out.index] += out.new_token_ids
            outputs.append(out)
    return tokens, outputs


def single(engine, prompt, params):
    run = run_group(engine, "single", prompt, params)
    return run[0][0]


@ARCHS
def test_seeded_choices_share_the_prefill_and_equal_single_requests(tiny, arch):
    engine = new_engine(tiny[arch].path)
    prompt = prompt_of(PROMPT_LEN, seed=4)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1234, n=4, ignore_eos=True)
    before = engine.scheduler.tokens_run
    tokens, outputs = run_group(engine, "g", prompt, params)
    # the prompt once, then 5 decode tokens per choice (the 6th token is sampled, never run)
    assert engine.scheduler.tokens_run - before == PROMPT_LEN + 4 * 5
    assert engine.caches.counters["state_copies"] == 3
    assert sorted({o.index for o in outputs if o.finished}) == [0, 1, 2, 3]
    for i in range(4):
        alone = single(engine, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=1234 + i, ignore_eos=True))
        assert tokens[i] == alone, f"choice {i}"
    assert len({tuple(t) for t in tokens.values()}) > 1  # different seeds drew different replies


@ARCHS
def test_greedy_choices_are_all_the_greedy_reply(tiny, arch):
    engine = new_engine(tiny[arch].path, block_size=4)
    prompt = prompt_of(PROMPT_LEN, seed=5)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens, _ = run_group(engine, "g", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=3))
    alone = single(engine, prompt, greedy)
    assert tokens == {0: alone, 1: alone, 2: alone}


def test_an_aborted_group_frees_every_choice(tiny):
    engine = new_engine(next(iter(tiny.values())).path)
    engine.add_request("g", prompt_of(PROMPT_LEN, seed=6), SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    engine.step()  # the prompt ran: three choices running
    assert len(engine.scheduler.running) == 3
    engine.abort("g")
    assert not engine.has_unfinished() and not engine.scheduler.requests


def test_an_aborted_group_before_its_prefill_ends(tiny):
    engine = new_engine(next(iter(tiny.values())).path)
    engine.add_request("g", prompt_of(PROMPT_LEN, seed=6), SamplingParams(max_tokens=5, n=3))
    assert engine.load().waiting_prefill_tokens == PROMPT_LEN  # the router prices the prompt once
    engine.abort("g")
    assert not engine.has_unfinished() and not engine.scheduler.requests


@pytest.mark.parametrize("params, field", [
    (dict(n=MAX_CHOICES + 1), "n must be in"),
    (dict(n=0), "n must be in"),
    (dict(n=2, deterministic=True), "n > 1 is not served in deterministic mode"),
])
def test_bad_n_is_refused(params, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**params)


def test_a_choice_without_room_computes_its_prompt_itself(tiny):
    """Two Mamba slots, three choices: the third finds no slot at the fork, waits, and computes
    its prompt (and its first token) itself once one is free: the same reply, not shared."""
    engine = new_engine(next(iter(tiny.values())).path, num_state_slots=2, head_cache_bytes=0, prefix_cache_bytes=0)
    prompt = prompt_of(PROMPT_LEN, seed=7)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=99, n=3, ignore_eos=True)
    before = engine.scheduler.tokens_run
    tokens, _ = run_group(engine, "g", prompt, params)
    # choices 0 and 1: the prompt once, 3 decodes each; choice 2: prompt + its first token, 2 decodes
    assert engine.scheduler.tokens_run - before == PROMPT_LEN + 2 * 3 + (PROMPT_LEN + 1) + 2
    for i in range(3):
        alone = single(engine, prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=99 + i, ignore_eos=True))
        assert tokens[i] == alone, f"choice {i}"


def test_only_choice_0_keeps_its_state(tiny):
    """A stateless request kept for reuse (keep=CHECKPOINT): choice 0's end is checkpointed, the
    other choices' states are freed (the integrity check after the test: nothing leaks)."""
    from workers.request import KeepState

    engine = new_engine(next(iter(tiny.values())).path)
    prompt = prompt_of(PROMPT_LEN, seed=8)
    request = engine.add_request("g", prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=5, n=3,
                                                             ignore_eos=True),
                                 keep=KeepState.CHECKPOINT, prefix_scope="salt")
    finals = {}
    while engine.has_unfinished():
        finals.update({o.index: o for o in engine.step() if o.finished})
    assert [label for label, _ in finals[0].checkpoints] == [0] and request.checkpoint_keys
    assert finals[1].checkpoints == () and finals[2].checkpoints == ()
    assert [key.length for key, _ in engine.caches.heads.index.items()] == [PROMPT_LEN + 2]


def test_each_choice_follows_its_own_grammar(tiny):
    """A constrained request of n choices: each choice has its own matcher; all start from the
    grammar's first mask (applied to the shared row) and end valid, as single requests do."""
    engine = new_engine(next(iter(tiny.values())).path)
    prompt = prompt_of(PROMPT_LEN, seed=9)
    choices = ["alpha", "beta", "gamma", "delta"]
    constraint = {"type": "choice", "choices": choices}
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=21, n=4, constraint=constraint)
    tokens, outputs = run_group(engine, "g", prompt, params)
    assert {o.index: o.finish_reason.value for o in outputs if o.finished} == {i: "stop" for i in range(4)}
    assert all(engine.tokenizer.decode(tokens[i]) in choices for i in range(4))
    for i in range(4):
        alone = SamplingParams(max_tokens=40, temperature=1.0, seed=21 + i, constraint=constraint)
        assert single(engine, prompt, alone) == tokens[i], f"choice {i}"
