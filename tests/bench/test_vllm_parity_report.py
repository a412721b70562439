"""bench.vllm_parity without its two servers (the comparison itself runs against both in
tests/serve/test_vllm_parity.py): what it compares per case, and the committed results
rendering to the committed table. Its full run starts vLLM's server with torch.compile's
warm-up (a minute or two here), so it has no smoke run in test_bench_smoke.py."""

from __future__ import annotations

import json

from bench.kit.results import RESULTS_DIR
from bench.vllm_parity.__main__ import main  # noqa: F401  (the command line imports)
from bench.vllm_parity.cases import Case, Compare, Endpoint
from bench.vllm_parity.measure import agreement
from bench.vllm_parity.report import markdown


def _reply(texts, reasons=("length",), completion_tokens=12, **extra) -> dict:
    return {"status": 200, "id": "chatcmpl-x", "texts": list(texts), "finish_reasons": list(reasons),
            "prompt_tokens": 5, "completion_tokens": completion_tokens, **extra}


def test_each_comparison_reads_only_what_it_names():
    reply, other = Case("f", {}), _reply(["ab"])
    assert agreement(reply, _reply(["ab"]), other) == (True, "")
    assert agreement(reply, _reply(["ab"], completion_tokens=13), other) == (False, "completion_tokens")
    assert agreement(Case("n", {}, compare=Compare.SHAPE), _reply(["xy"]), other)[0]  # seeded draws differ
    assert not agreement(Case("n", {}, compare=Compare.SHAPE), _reply(["xy"], reasons=("stop",)), other)[0]
    assert agreement(reply, {"status": 400, "error": "no"}, other) == (False, "status 400 / 200")
    echo = Case("echo", {}, Endpoint.COMPLETIONS, Compare.ECHO)
    prompt = [None, -1.0, -2.0, -3.0, -4.0, -5.0]  # five prompt tokens, then the sampled one
    near = [None, -1.0, -2.0, -3.0, -4.0 + 5e-4, -5.5]  # the sampled token's logprob is not the prompt's
    assert agreement(echo, _reply(["p"], prompt_logprobs=prompt), _reply(["p"], prompt_logprobs=near))[0]
    far = [None, -1.0, -2.01, -3.0, -4.0, -5.0]
    assert not agreement(echo, _reply(["p"], prompt_logprobs=prompt), _reply(["p"], prompt_logprobs=far))[0]


def test_the_committed_results_render_to_the_committed_table():
    data = json.loads((RESULTS_DIR / "vllm_parity.json").read_text())
    assert markdown(data).rstrip("\n") == (RESULTS_DIR / "vllm_parity.md").read_text().rstrip("\n")
    assert sum(row["agree"] for row in data["rows"]) >= 26  # 26 of 32 when committed; the rest are known
