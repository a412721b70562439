"""The command line: `generate --json` (a real subprocess) prints the engine's greedy tokens;
`make-model` writes a checkpoint the engine loads; errors exit with status 2 and a one-line
message (these in-process through `main`: each subprocess costs seconds of imports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.conftest import hf_greedy, new_engine, run_engine
from workers.checkpoint import EOS_TOKEN_ID, Arch
from workers.cli import main
from workers.model.loader import load_model
from workers.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 2, 3]


def _start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )


@pytest.fixture(scope="module")
def generate_proc(tiny):
    """`generate` as a real subprocess, started early: it spends most of its time importing
    torch and transformers, while the in-process tests below run."""
    proc = _start("generate", "--model", str(tiny[Arch.NEMOTRON_H].path), "--prompt-ids", "1,2,3",
                  "--max-tokens", "5", "--json", "--logprobs", "2")
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_make_model_writes_a_loadable_checkpoint(generate_proc, tmp_path, capsys):
    made = tmp_path / "made"
    assert main(["make-model", str(made), "--arch", "granitemoehybrid", "--preset", "tiny", "--seed", "4"]) == 0
    assert str(made) in capsys.readouterr().out
    model = load_model(made)
    assert model.config.family.value == "granitemoehybrid"
    engine = new_engine(made)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = run_engine(engine, {"m": [10, 11, 12, 13]}, params).tokens["m"]
    assert len(tokens) == 4
    # The CLI generates on it from a text prompt rendered with the checkpoint's chat template.
    assert main(["generate", "--model", str(made), "--prompt", "hi", "--max-tokens", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected_prompt = engine.tokenizer.encode(engine.tokenizer.render_chat([{"role": "user", "content": "hi"}]))
    assert result["prompt_token_ids"] == expected_prompt
    ref = run_engine(engine, {"hi": expected_prompt}, SamplingParams(max_tokens=3, temperature=0.0)).tokens["hi"]
    assert result["token_ids"] == ref


def test_generate_json_prints_the_engines_greedy_tokens(generate_proc, tiny):
    out, err = generate_proc.communicate(timeout=300)
    assert generate_proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    ckpt = tiny[Arch.NEMOTRON_H]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)  # the CLI's defaults
    run = run_engine(new_engine(ckpt.path), {"cli": PROMPT}, params)
    assert result["prompt_token_ids"] == PROMPT
    assert result["token_ids"] == run.tokens["cli"]
    assert result["finish_reason"] == run.requests["cli"].finish_reason.value
    assert result["text"] == run.text["cli"]
    assert len(result["logprobs"]) == len(result["token_ids"])
    assert all(len(top) == 2 for top in result["top_logprobs"])
    greedy = hf_greedy(ckpt, PROMPT, 5)
    expected = greedy[: greedy.index(EOS_TOKEN_ID) + 1] if EOS_TOKEN_ID in greedy else greedy
    assert result["token_ids"] == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,x,3"], "comma-separated"),
        (["--prompt-ids", "1,999"], "out of range"),
        (["--prompt-ids", "1,2", "--top-p", "0"], "top_p"),
    ],
    ids=["not-integers", "out-of-range", "bad-top-p"],
)
def test_generate_errors_exit_2_with_a_message(tiny, capsys, args, message):
    assert main(["generate", "--model", str(tiny[Arch.BAMBA].path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
