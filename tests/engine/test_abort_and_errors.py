"""Aborts free everything; bad input fails with a typed error and never disturbs the other
requests; a malformed checkpoint is refused with CheckpointError / UnsupportedModelError
naming what is wrong; a failing model step fails only the requests of that step.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.conftest import GREEDY, assert_all_free, new_engine, prompt_of, run_engine
from workers.checkpoint import Arch
from workers.errors import CheckpointError, EngineError, InvalidRequestError, PromptTooLongError, UnsupportedModelError
from workers.request import FinishReason, RequestStatus
from workers.sampling import SamplingParams

GOOD = prompt_of(20, seed=42)


@pytest.fixture(scope="module")
def bamba(tiny):
    return tiny[Arch.BAMBA]


@pytest.fixture(scope="module")
def good_tokens(bamba):
    """What the good request produces on a fresh engine."""
    return run_engine(new_engine(bamba.path), {"good": GOOD}).tokens["good"]


@pytest.fixture
def engine(bamba):
    """An engine that has to keep serving after each bad input (max_model_len 64)."""
    return new_engine(bamba.path, max_model_len=64)


def _serves_good_request(engine, good_tokens, bad_action):
    """Start a good request, do something bad, then check the good one completes unchanged."""
    good = engine.add_request("good", GOOD, GREEDY)
    engine.step()  # the good request is mid-flight when the bad one arrives
    bad_action()
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
    assert good.output_token_ids == good_tokens
    assert good.finish_reason is FinishReason.LENGTH


# -- bad requests ----------------------------------------------------------------------------
BAD_PROMPTS = {
    "too-long": list(range(6, 70)),  # 64 tokens, max_model_len 64 leaves no room for output
    "way-too-long": [7] * 500,
    "empty": [],
    "negative-id": [5, -1, 6],
    "id-equal-to-vocab": [5, 104],
    "huge-id": [2**40],
}


@pytest.mark.parametrize("name", list(BAD_PROMPTS))
def test_bad_prompt_is_refused_and_others_keep_running(engine, good_tokens, name):
    def bad():
        with pytest.raises(InvalidRequestError) as refused:
            engine.add_request("bad", BAD_PROMPTS[name], GREEDY)
        # Only length refusals are typed as too long (the HTTP layer answers them with 413).
        assert isinstance(refused.value, PromptTooLongError) == name.endswith("too-long")
        assert "bad" not in engine.scheduler.requests

    _serves_good_request(engine, good_tokens, bad)


@pytest.mark.parametrize("ids", [[5, 6.5, 7], [5, 6.0], [5, "7"]], ids=["float", "integral-float", "str"])
def test_non_integer_token_ids_are_refused(engine, good_tokens, ids):
    """A float id must be refused at admission, not crash the batch it would join."""

    def bad():
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", ids, GREEDY)

    _serves_good_request(engine, good_tokens, bad)


def test_prompt_one_below_max_model_len_stops_with_length(engine):
    run = run_engine(engine, {"edge": prompt_of(63, seed=1)}, SamplingParams(max_tokens=10, temperature=0.0))
    assert len(run.tokens["edge"]) == 1
    assert run.requests["edge"].finish_reason is FinishReason.LENGTH


def test_duplicate_request_id_is_refused(engine, good_tokens):
    def bad():
        with pytest.raises(InvalidRequestError):
            engine.add_request("good", prompt_of(5, seed=3), GREEDY)

    _serves_good_request(engine, good_tokens, bad)


INVALID_PARAMS = [
    dict(max_tokens=0),
    dict(max_tokens=-3),
    dict(max_tokens=2.5),
    dict(temperature=-0.5),
    dict(temperature=1000.0),
    dict(temperature=math.nan),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(top_p=math.nan),
    dict(top_k=-1),
    dict(logprobs=-1),
    dict(logprobs=21),
    dict(seed=-1),
    dict(seed=2**63),
    dict(stop=("",)),
    dict(include_stop_str_in_output="yes"),
]


@pytest.mark.parametrize("kwargs", INVALID_PARAMS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [dict(top_k=2.5), dict(logprobs=1.5), dict(seed=1.5)], ids=["top_k=2.5", "logprobs=1.5", "seed=1.5"]
)
def test_non_integer_sampling_params_are_refused(engine, good_tokens, kwargs):
    """Accepting these makes the sampler raise TypeError inside engine.step() (outside the
    step's error handling), which takes down every request of the engine."""

    def bad():
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", prompt_of(5, seed=3), SamplingParams(temperature=1.0, **kwargs))

    _serves_good_request(engine, good_tokens, bad)


def test_stop_given_as_a_bare_string_is_not_split_into_characters():
    """stop="ab" must mean the string "ab" (or be refused), never the stop strings "a" and "b"."""
    try:
        params = SamplingParams(stop="ab")
    except InvalidRequestError:
        return
    assert tuple(params.stop) == ("ab",)


# -- aborts ----------------------------------------------------------------------------------
@pytest.fixture
def chunky(bamba):
    """Budget 8 tokens a step, so a 40-token prompt takes 5 steps to prefill."""
    return new_engine(bamba.path, max_num_batched_tokens=8)


def test_abort_mid_prefill_frees_everything(chunky, bamba):
    prompt = prompt_of(40, seed=5)
    request = chunky.add_request("a", prompt, GREEDY)
    assert chunky.step() == []  # first chunk: nothing sampled yet
    assert request.status is RequestStatus.RUNNING and 0 < request.num_computed_tokens < len(prompt)
    chunky.abort("a")
    assert request.finish_reason is FinishReason.ABORT and request.is_finished
    assert not chunky.has_unfinished()
    assert_all_free(chunky)
    chunky.check_integrity()
    # The same id and prompt afterwards behave like on a fresh engine.
    again = run_engine(chunky, {"a": prompt}).tokens["a"]
    assert again == run_engine(new_engine(bamba.path), {"a": prompt}).tokens["a"]


def test_abort_mid_decode_frees_everything_and_spares_the_others(chunky, bamba):
    prompts = {"a": prompt_of(12, seed=6), "b": prompt_of(7, seed=7)}
    ref = run_engine(new_engine(bamba.path), prompts).tokens
    a = chunky.add_request("a", prompts["a"], GREEDY)
    b = chunky.add_request("b", prompts["b"], GREEDY)
    while len(a.output) < 3:
        chunky.step()
    chunky.abort("a")
    assert a.finish_reason is FinishReason.ABORT and len(a.output) == 3
    assert a.output_token_ids == ref["a"][:3]
    while chunky.has_unfinished():
        chunky.step()
    assert b.output_token_ids == ref["b"]
    assert_all_free(chunky)


def test_abort_waiting_and_unknown_requests(bamba):
    engine = new_engine(bamba.path, max_num_seqs=1)
    first = engine.add_request("first", prompt_of(9, seed=1), GREEDY)
    queued = engine.add_request("queued", prompt_of(9, seed=2), GREEDY)
    engine.step()
    assert queued.status is RequestStatus.WAITING
    engine.abort("queued")
    assert queued.finish_reason is FinishReason.ABORT
    engine.abort("queued")  # twice: no-op
    engine.abort("never-existed")
    while engine.has_unfinished():
        engine.step()
    assert first.finish_reason is FinishReason.LENGTH
    engine.abort("first")  # already finished: no-op
    assert first.finish_reason is FinishReason.LENGTH
    assert_all_free(engine)


def test_aborts_in_every_phase_of_a_busy_engine(bamba):
    """Many requests, small budget: abort one every step, whatever its phase; nothing leaks."""
    engine = new_engine(bamba.path, max_num_batched_tokens=10, max_num_seqs=4)
    prompts = {f"r{i}": prompt_of(3 + 4 * i, seed=i) for i in range(8)}
    ref = run_engine(new_engine(bamba.path), prompts).tokens
    requests = {rid: engine.add_request(rid, p, GREEDY) for rid, p in prompts.items()}
    for victim in ("r1", "r6", "r3", "r7"):
        engine.step()
        engine.abort(victim)
        engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
    for rid, request in requests.items():
        if request.finish_reason is FinishReason.ABORT:
            assert request.output_token_ids == ref[rid][: len(request.output)]
        else:
            assert request.output_token_ids == ref[rid]
    assert sum(r.finish_reason is FinishReason.ABORT for r in requests.values()) == 4
    assert_all_free(engine)


def test_integrity_check_catches_leaks(bamba):
    """The check run after every test is not vacuous: a leaked block or slot trips it."""
    from workers.config import CacheConfig, EngineConfig
    from workers.engine import LLMEngine

    config = EngineConfig(model=str(bamba.path), cache=CacheConfig(kv_cache_bytes=1 << 20, head_cache_bytes=1 << 20))
    engine = LLMEngine(config)  # not registered: it ends up corrupt
    engine.check_integrity()
    engine.caches.kv.pool.allocate(1)  # a block no table refers to
    with pytest.raises(AssertionError):
        engine.check_integrity()
    engine = LLMEngine(config)
    engine.caches.states._free.pop()  # a slot nobody holds and that is not free
    with pytest.raises(AssertionError):
        engine.check_integrity()


# -- a failing model step ----------------------------------------------------------------------
def _fail_call(monkeypatch, engine, which: int):
    """Make the `which`-th model forward from now raise (once)."""
    inner = engine.model.forward
    calls = {"n": 0}

    def forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == which:
            raise RuntimeError("injected failure")
        return inner(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", forward)


@pytest.mark.parametrize("which", [1, 4], ids=["during-prefill", "during-decode"])
def test_failing_step_fails_only_its_requests(bamba, monkeypatch, which):
    engine = new_engine(bamba.path, max_num_seqs=2)
    prompts = {"a": prompt_of(11, seed=1), "b": prompt_of(17, seed=2), "c": prompt_of(5, seed=3)}
    ref = run_engine(new_engine(bamba.path), prompts).tokens
    _fail_call(monkeypatch, engine, which)
    requests = {rid: engine.add_request(rid, p, GREEDY) for rid, p in prompts.items()}
    errors = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                errors[out.request_id] = out
    assert set(errors) == {"a", "b"}  # c was waiting (max_num_seqs=2) and is unaffected
    for rid in ("a", "b"):
        assert errors[rid].finished and errors[rid].finish_reason is FinishReason.ERROR
        assert "injected failure" in errors[rid].error
        assert requests[rid].finish_reason is FinishReason.ERROR
    assert requests["c"].output_token_ids == ref["c"]
    assert_all_free(engine)
    # The next requests work, including reusing the failed ids.
    assert run_engine(engine, {"a": prompts["a"], "d": prompts["b"]}).tokens == {"a": ref["a"], "d": ref["b"]}


def test_generate_raises_on_a_failed_step(bamba, monkeypatch):
    engine = new_engine(bamba.path)
    _fail_call(monkeypatch, engine, 1)
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.generate([prompt_of(5, seed=1)], GREEDY)
    assert not engine.has_unfinished()
    assert_all_free(engine)


# -- malformed checkpoints ---------------------------------------------------------------------
@pytest.fixture
def copy_of(tiny, tmp_path):
    def copy(arch: Arch):
        dst = tmp_path / arch.value
        shutil.copytree(tiny[arch].path, dst)
        return dst

    return copy


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _open(path):
    return new_engine(path)


def test_missing_config_json(copy_of):
    path = copy_of(Arch.BAMBA)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        _open(path)


def test_config_json_not_json(copy_of):
    path = copy_of(Arch.BAMBA)
    (path / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="JSON"):
        _open(path)


def test_no_safetensors(copy_of):
    path = copy_of(Arch.NEMOTRON_H)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        _open(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.001])
def test_truncated_safetensors(copy_of, keep):
    path = copy_of(Arch.GRANITEMOEHYBRID)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: max(1, int(len(data) * keep))])
    with pytest.raises(CheckpointError):
        _open(path)


def test_wrong_tensor_shape_names_the_tensor(copy_of):
    path = copy_of(Arch.BAMBA)
    name = "model.layers.1.mamba.A_log"

    def edit(t):
        t[name] = torch.zeros(t[name].shape[0] + 1)

    _edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=r"A_log.*shape"):
        _open(path)


def test_missing_tensor_is_reported(copy_of):
    path = copy_of(Arch.NEMOTRON_H)
    _edit_tensors(path, lambda t: t.pop("backbone.norm_f.weight"))
    with pytest.raises(CheckpointError, match="missing"):
        _open(path)


def test_unexpected_tensor_is_reported(copy_of):
    path = copy_of(Arch.BAMBA)

    def edit(t):
        t["model.layers.0.something_new.weight"] = torch.zeros(3)

    _edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match="something_new"):
        _open(path)


@pytest.mark.parametrize(
    "arch, changes, field",
    [
        (Arch.GRANITEMOEHYBRID, dict(num_local_experts=4, num_experts_per_tok=0), "num_experts_per_tok"),
        (Arch.BAMBA, dict(hidden_act="gelu"), "hidden_act"),
        (Arch.GRANITEMOEHYBRID, dict(hidden_act="relu"), "hidden_act"),
        (Arch.NEMOTRON_H, dict(mlp_hidden_act="gelu"), "mlp_hidden_act"),
        (Arch.NEMOTRON_H, dict(mamba_hidden_act="relu"), "mamba_hidden_act"),
        (Arch.NEMOTRON_H, dict(layers_block_type=["linear_attention", "conv", "full_attention"]), "layers_block_type"),
        (Arch.NEMOTRON_H, dict(layers_block_type=["linear_attention", "moe", "full_attention"], n_routed_experts=4,
                               num_experts_per_tok=2, moe_latent_size=16), "moe_latent_size"),
        (Arch.BAMBA, dict(model_type="llama"), "model_type"),
        (Arch.BAMBA, dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}),
         "rope_parameters.rope_type"),
        (Arch.BAMBA, dict(mamba_n_heads=None), "mamba_n_heads"),
        (Arch.GRANITEMOEHYBRID, dict(layer_types=["mamba", "attention"]), "layer_types"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_config_names_the_field(copy_of, arch, changes, field):
    path = copy_of(arch)
    _edit_config(path, **changes)
    with pytest.raises(UnsupportedModelError) as info:
        _open(path)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, EngineError)
