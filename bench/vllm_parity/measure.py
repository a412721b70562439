"""Sends each case to both servers and compares what must agree (cases.Compare). Takes base URLs
only: the benchmark starts its servers (servers.py), the suite's test its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from bench.vllm_parity.cases import ECHO_TOLERANCE, Case, Compare, Endpoint, Greedy, cases, plain_cases
from bench.vllm_parity.checkpoint import never_sampled, vocab_size


@dataclass(frozen=True)
class Server:
    name: str
    base_url: str
    model: str  # the name it serves the checkpoint under
    extra: dict[str, Any]  # added to every request (vLLM's: the ids our engine may sample)


def vllm_extra(model_dir: Path) -> dict[str, Any]:
    """vLLM's server samples every id; our engine never samples the checkpoint's control ids."""
    banned = never_sampled(model_dir)
    return {"allowed_token_ids": [i for i in range(vocab_size(model_dir)) if i not in banned]}


def ask(http: httpx.Client, server: Server, case: Case) -> dict[str, Any]:
    """The reply as the comparison reads it (or the error the server answered)."""
    response = http.post(f"{server.base_url}{case.endpoint.value}", json=case.request(server.model) | server.extra)
    body = response.json()
    if response.status_code != 200:
        error = body.get("error", body)
        return {"status": response.status_code, "error": (error.get("message") if isinstance(error, dict)
                                                          else str(error))[:300]}
    choices = sorted(body["choices"], key=lambda c: c["index"])
    texts = [c["message"]["content"] if case.endpoint is Endpoint.CHAT else c["text"] for c in choices]
    reply: dict[str, Any] = {
        "status": 200, "id": body["id"], "texts": texts, "finish_reasons": [c["finish_reason"] for c in choices],
        "prompt_tokens": body["usage"]["prompt_tokens"], "completion_tokens": body["usage"]["completion_tokens"]}
    if case.compare is Compare.ECHO:
        reply["prompt_logprobs"] = choices[0]["logprobs"]["token_logprobs"]
    return reply


def agreement(case: Case, vllm: dict[str, Any], ours: dict[str, Any]) -> tuple[bool, str]:
    """Whether the replies agree on what the case compares, and where they differ if not."""
    if vllm["status"] != 200 or ours["status"] != 200:
        return vllm["status"] == ours["status"], f"status {vllm['status']} / {ours['status']}"
    keys = {Compare.REPLY: ("texts", "finish_reasons", "prompt_tokens", "completion_tokens"),
            Compare.SHAPE: ("finish_reasons", "prompt_tokens", "completion_tokens"),
            Compare.ID: ("id",), Compare.ECHO: ("texts", "prompt_tokens")}[case.compare]
    differ = [key for key in keys if vllm[key] != ours[key]]
    if case.compare is Compare.ECHO:  # the prompt's tokens (the first has none); the sampled one's: sampled_gap
        a, b = (reply["prompt_logprobs"][: reply["prompt_tokens"]] for reply in (vllm, ours))
        gap = echo_gap(vllm, ours) if len(a) == len(b) else None
        if a[0] is not None or b[0] is not None or gap is None or gap > ECHO_TOLERANCE:
            differ.append(f"prompt logprobs (largest gap {gap})")
    return not differ, ", ".join(differ)


def echo_gap(vllm: dict[str, Any], ours: dict[str, Any], sampled: bool = False) -> float:
    """The largest difference of the prompt's logprobs (sampled: of the tokens after the prompt)."""
    start, end = (vllm["prompt_tokens"], None) if sampled else (1, vllm["prompt_tokens"])
    return max((abs(x - y) for x, y in zip(vllm["prompt_logprobs"][start:end], ours["prompt_logprobs"][start:end],
                                           strict=True)), default=0.0)


def changed(case: Case, reply: dict[str, Any], plain: dict[str, Any]) -> bool | None:
    """Whether the field changed the server's plain greedy reply (None: nothing to compare)."""
    if reply["status"] != 200 or case.compare is not Compare.REPLY:
        return None
    return (reply["texts"], reply["finish_reasons"], reply["prompt_tokens"]) != (
        plain["texts"], plain["finish_reasons"], plain["prompt_tokens"])


def compare(vllm: Server, ours: Server, model_dir: Path, only: set[str] | None = None) -> list[dict[str, Any]]:
    """One row per case (only: the fields to run, all if None), the plain greedy replies first."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    with httpx.Client(timeout=300) as http:
        plain = {}
        for case in plain_cases():
            replies = {server.name: ask(http, server, case) for server in (vllm, ours)}
            plain[case.endpoint] = replies
            rows.append(_row(case, replies, vllm, ours, None))
        chat, completion = (_greedy(tokenizer, plain[endpoint][ours.name]["texts"][0]) for endpoint in Endpoint)
        eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        other = next(i for i in tokenizer.encode("zqx", add_special_tokens=False) if i != chat.ids[0])
        for case in cases(chat, completion, eos, other):
            if only is not None and case.field not in only:
                continue
            replies = {server.name: ask(http, server, case) for server in (vllm, ours)}
            rows.append(_row(case, replies, vllm, ours, plain[case.endpoint]))
    return rows


def _greedy(tokenizer, text: str) -> Greedy:
    return Greedy(tokenizer.encode(text, add_special_tokens=False), text)


def _row(case: Case, replies: dict, vllm: Server, ours: Server, plain: dict | None) -> dict[str, Any]:
    agree, where = agreement(case, replies[vllm.name], replies[ours.name])
    row = {"field": case.field, "endpoint": case.endpoint.value, "compare": case.compare.value, "note": case.note,
           "request": case.body, "vllm": replies[vllm.name], "ours": replies[ours.name], "agree": agree,
           "differs_in": where}
    if case.compare is Compare.ECHO and agree:
        row["sampled_logprob_gap"] = echo_gap(replies[vllm.name], replies[ours.name], sampled=True)
    if plain is not None:
        row["changed"] = {name: changed(case, replies[name], plain[name]) for name in (vllm.name, ours.name)}
    return row
