"""`python -m bench.gpu_check --smoke` on the CPU: every check runs on the tiny models and passes,
and the JSON and Markdown are written (the committed results are never touched).

The same command on a GPU machine runs the full plan (`bench/gpu_check/__init__.py`)."""

from __future__ import annotations

import json

from bench.gpu_check.__main__ import main
from bench.gpu_check.plan import LOGIT_MODELS
from bench.gpu_check.report import markdown


def test_gpu_check_smoke_runs_every_check_and_writes_results(tmp_path):
    status = main(["--smoke", "--device", "cpu", "--results-dir", str(tmp_path)])
    results = json.loads((tmp_path / "gpu.smoke.json").read_text())
    errors = [r.get("error") for r in [*results["logits"], results["conversation"], *results["determinism"]]]
    assert status == 0, [e for e in errors if e]
    assert [r["model"] for r in results["logits"]] == [name for name, _, _ in LOGIT_MODELS]
    assert all(r["passed"] and r["fp32_error"] <= 1e-4 for r in results["logits"])
    assert results["conversation"]["passed"] and results["conversation"]["cached_tokens"] > 0
    prompt = results["prompt_logprobs"]  # a chunked prefill's prompt logprobs == transformers'
    assert prompt["passed"] and prompt["tokens_right"] and prompt["chunk"] < prompt["prompt_tokens"]
    assert all(r["passed"] and r["bit_identical"] == r["requests"] for r in results["determinism"])
    speed = results["throughput"]
    assert speed["passed"] and {r["side"] for r in speed["runs"]} == {"ours", "transformers"}
    assert all(r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in speed["runs"])
    text = markdown(results)
    assert (tmp_path / "gpu.smoke.md").read_text() == (text if text.endswith("\n") else text + "\n")
