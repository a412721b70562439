"""Deterministic requests through the engine's whole lifecycle: stop conditions inside a
window, preemption, aborts, seeds derived without a random draw, metrics, the CLI flag."""

from __future__ import annotations

import json

from tests.determinism.helpers import DET_PROMPTS, Arrival, background_load, det_arrivals, det_params, drive, new_engine
from workers.checkpoint import Arch
from workers.cli import main
from workers.deterministic.seed import derived_seed
from workers.request import FinishReason

PROMPT = DET_PROMPTS["d-long"]


def _reference(model_dir, **params):
    engine = new_engine(model_dir)
    return drive(engine, [Arrival(0, "r", PROMPT, det_params(**params))])


def test_stop_token_inside_a_window_ends_at_the_verified_token(det_models):
    ref = _reference(det_models[Arch.BAMBA])
    tokens = ref.tokens["r"]
    stop_at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i] and i % 16 not in (0, 15))
    engine = new_engine(det_models[Arch.BAMBA])
    out = drive(engine, [Arrival(0, "s", PROMPT, det_params(stop_token_ids=(tokens[stop_at],)))])
    assert out.tokens["s"] == tokens[: stop_at + 1]
    assert out.logprobs["s"] == ref.logprobs["r"][: stop_at + 1]
    assert not out.unverified_streamed


def test_stop_string_and_length_inside_a_window(det_models):
    ref = _reference(det_models[Arch.BAMBA])
    text = ref.text["r"]
    stop = text[7:9]
    assert stop and stop not in text[:8]
    engine = new_engine(det_models[Arch.BAMBA])
    out = drive(engine, [Arrival(0, "s", PROMPT, det_params(stop=(stop,))), Arrival(0, "l", PROMPT, det_params(max_tokens=21))])
    assert out.text["s"] == text[: text.index(stop)]
    assert out.tokens["l"] == ref.tokens["r"][:21] and out.logprobs["l"] == ref.logprobs["r"][:21]


def test_preempted_deterministic_requests_resume_with_the_same_bits(det_models):
    model = det_models[Arch.GRANITEMOEHYBRID]
    ref = drive(new_engine(model), det_arrivals())
    probe = new_engine(model)
    tiny_pool = new_engine(model, kv_bytes=30 * probe.kv_layout.block_bytes)  # 30 blocks of 4; 50 needed
    out = drive(tiny_pool, det_arrivals())
    assert tiny_pool.scheduler.num_preemptions > 0, "the tiny pool should force a preemption"
    assert out.of(DET_PROMPTS) == ref.of(DET_PROMPTS)
    assert not out.unverified_streamed


def test_abort_with_unverified_candidates_frees_everything(det_models):
    engine = new_engine(det_models[Arch.NEMOTRON_H])
    request = engine.add_request("a", PROMPT, det_params(max_tokens=200))
    for _ in range(8):
        engine.step()
    assert request.num_tokens > request.num_verified  # candidates in flight
    engine.abort("a")
    assert request.finish_reason is FinishReason.ABORT and not engine.has_unfinished()


def test_unseeded_requests_get_a_seed_from_the_prompt(det_models):
    params = det_params(temperature=1.0)
    assert params.seed is None
    a = drive(new_engine(det_models[Arch.BAMBA]), [Arrival(0, "r", PROMPT, params)])
    b = drive(new_engine(det_models[Arch.BAMBA]), [Arrival(0, "r", PROMPT, params)])
    seeded = drive(new_engine(det_models[Arch.BAMBA]), [Arrival(0, "r", PROMPT, det_params(temperature=1.0, seed=derived_seed(PROMPT)))])
    assert a.of(["r"]) == b.of(["r"]) == seeded.of(["r"])
    assert derived_seed(PROMPT) != derived_seed(PROMPT + [7]) and 0 <= derived_seed(PROMPT) < 2**63


def test_metrics_count_windows_rollbacks_and_time(det_models):
    engine = new_engine(det_models[Arch.BAMBA], mismatch_rate=0.2)
    drive(engine, det_arrivals())
    m = engine.verifier.metrics.as_dict()
    # 3 requests, 40 tokens each past prompts of 5/37/32: at least 3 tiles each.
    assert m["windows_verified"] >= 9 and m["passes"] >= 3
    assert m["rollbacks"] > 0 and m["tokens_redone"] >= m["rollbacks"]
    assert m["tokens_verified"] >= 3 * 40
    assert 0 < m["verify_time_share"] < 1


def test_cli_deterministic_flag(det_models, capsys):
    args = ["generate", "--model", str(det_models[Arch.BAMBA]), "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-tokens", "6", "--temperature", "0.9", "--json", "--logprobs", "1", "--deterministic"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert first == second and len(first["token_ids"]) == 6


def test_tile_only_decoding_gives_the_same_bits(det_models):
    """The benchmark's baseline (every token from a tile pass) computes the same canonical
    function as decode-verify-rollback: the same bits, under load or not."""
    ref = drive(new_engine(det_models[Arch.NEMOTRON_H]), det_arrivals())
    tiles_only = new_engine(det_models[Arch.NEMOTRON_H], fast_decode=False)
    out = drive(tiles_only, det_arrivals() + background_load(seed=2, max_requests=6))
    assert out.of(DET_PROMPTS) == ref.of(DET_PROMPTS)
    assert tiles_only.verifier.metrics.rollbacks == 0
    assert tiles_only.verifier.metrics.tokens_verified == sum(len(t) for t in ref.tokens.values())
