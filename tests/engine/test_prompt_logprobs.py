"""Prompt logprobs (vLLM's `prompt_logprobs`, completions' `echo` with `logprobs`): each prompt
token's logprob, rank and top k equal transformers' full forward's log_softmax, whether the
prompt runs in one prefill, in chunks shared with other requests, or after a request that left
its prefix cached (that prefix is not reused: every row runs)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import hf_logits, new_engine, prompt_of
from tests.families import ARCHS
from workers.errors import InvalidRequestError
from workers.request import CheckpointMark, KeepState
from workers.sampling import SamplingParams

TOL = 1e-4  # fp32
K = 3


def _params(k: int | None = K) -> SamplingParams:
    return SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=k)


def _run(engine, prompts: dict[str, list[int]], params: SamplingParams, **kwargs) -> dict:
    """Every request to its end: its prompt logprobs (on exactly one output) and its outputs."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params, **kwargs)
    got: dict[str, list] = {rid: [] for rid in prompts}
    cached = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            if out.prompt_logprobs is not None:
                got[out.request_id].append(out.prompt_logprobs)
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    assert all(len(v) == 1 for v in got.values()), {k: len(v) for k, v in got.items()}
    return {rid: (v[0], cached[rid]) for rid, v in got.items()}


def _check(ckpt, ids: list[int], entries, k: int = K) -> None:
    reference = torch.log_softmax(hf_logits(ckpt, ids), dim=-1)  # row p predicts token p+1
    assert len(entries) == len(ids) and entries[0].token_id == ids[0] and entries[0].logprob is None
    for p, entry in enumerate(entries[1:]):
        row, token = reference[p], ids[p + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=TOL)
        assert int((row > row[token] + TOL).sum()) + 1 <= entry.rank <= int((row > row[token] - TOL).sum()) + 1
        values, top = torch.topk(row, k)
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=TOL)
        assert [t for t, _ in entry.top][:1] == top.tolist()[:1]


@ARCHS
def test_prompt_logprobs_equal_a_full_forward(tiny, arch):
    engine = new_engine(tiny[arch].path)
    ids = prompt_of(40, seed=1)
    (entries, _), = _run(engine, {"one": ids}, _params()).values()
    _check(tiny[arch], ids, entries)


@ARCHS
def test_prompt_logprobs_across_prefill_chunks(tiny, arch):
    """A budget of 7 tokens a step: each prompt runs in chunks, beside the other's."""
    engine = new_engine(tiny[arch].path, max_num_batched_tokens=7)
    prompts = {"a": prompt_of(33, seed=2), "b": prompt_of(20, seed=3)}
    got = _run(engine, prompts, _params())
    for rid, ids in prompts.items():
        _check(tiny[arch], ids, got[rid][0])


def test_top_zero_and_a_one_token_prompt(tiny):
    ckpt = next(iter(tiny.values()))
    engine = new_engine(ckpt.path)
    got = _run(engine, {"k0": prompt_of(9, seed=4), "single": [7]}, _params(0))
    _check(ckpt, prompt_of(9, seed=4), got["k0"][0], k=0)
    assert all(e.top == () for e in got["k0"][0][1:])
    assert [(e.token_id, e.logprob) for e in got["single"][0]] == [(7, None)]


def test_a_cached_prefix_is_not_reused_for_prompt_logprobs(tiny):
    """The first request checkpoints its prompt; the second (same scope) computes every row."""
    ckpt = next(iter(tiny.values()))
    engine = new_engine(ckpt.path)
    ids = prompt_of(30, seed=5)
    scope = dict(prefix_scope="salt", keep=KeepState.CHECKPOINT, marks=(CheckpointMark(len(ids) - 1, label=1),))
    engine.add_request("first", ids, SamplingParams(max_tokens=2, temperature=0.0), **scope)
    while engine.has_unfinished():
        engine.step()
    (entries, cached), = _run(engine, {"second": ids}, _params(), **scope).values()
    assert cached == 0
    _check(ckpt, ids, entries)
    without = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request("third", ids, without, **scope)  # the control: without them, the prefix is reused
    outs = [o for _ in range(100) if engine.has_unfinished() for o in engine.step()]
    assert outs[-1].finished and outs[-1].num_cached_tokens == len(ids) - 1


def test_deterministic_mode_refuses_prompt_logprobs(tiny):
    engine = new_engine(next(iter(tiny.values())).path)
    params = SamplingParams(max_tokens=2, temperature=0.0, deterministic=True, prompt_logprobs=1)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        engine.add_request("det", prompt_of(5, seed=6), params)


@ARCHS
def test_n_choices_carry_the_prompt_logprobs_once(tiny, arch):
    """n > 1: the prompt is the group's, run once (choice 0's prefill, chunked here): its logprobs
    come once, on choice 0's output; the forks, which start after it, carry none."""
    engine = new_engine(tiny[arch].path, max_num_batched_tokens=7)
    ids = prompt_of(23, seed=7)
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=11, ignore_eos=True, prompt_logprobs=K, n=3)
    before = engine.scheduler.tokens_run
    engine.add_request("g", ids, params)
    carried, replies = [], {i: [] for i in range(3)}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            replies[out.index] += out.new_token_ids
            if out.prompt_logprobs is not None:
                carried.append((out.index, out.prompt_logprobs))
    assert engine.scheduler.tokens_run - before == len(ids) + 3 * 2  # the prompt once, 2 decodes a choice
    assert [index for index, _ in carried] == [0]
    _check(tiny[arch], ids, carried[0][1])
    assert all(len(r) == 3 for r in replies.values())
