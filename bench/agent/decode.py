"""The cost of constrained decoding in `bench.agent`: decode time per output token at a given
concurrency with the grammar on and off, in our app, the same prompts and max_tokens.

Two pairs, each prompt under a cache_salt of its own that a warm-up round filled (so a request
is a cached prefix, a short prefill and its decode):

  tool_call    the agent's first step (tools in the system message): tool_choice "required"
               (parallel_tool_calls False) vs tool_choice "none" (the same prompt, no grammar);
  json_schema  a short request: a json_schema response_format vs none.

max_tokens is below the shortest reply the grammars allow; requests sample (temperature 1, a
seed per prompt: greedy replies of the random-weight model end at once without a grammar), and
the unconstrained ones are sent with ignore_eos (vLLM's field, no logits processor: a plain
decode step), so both sides reply max_tokens tokens and the batches are the same size all
along (their token counts are recorded; before, unconstrained replies ended after 2-33 tokens
and the grammar's steps were compared with smaller batches). The judged measure is each
request's time after its first delta over its tokens after the first (the usage's count), median
over the requests of every round: a delta may carry several tokens' text (a token that completes
no character, as the random-weight model's byte tokens often do unconstrained, sends none and its
text comes with the next), so gaps between deltas are not steps, and not alike on both sides. A forced call's first
delta comes once its name is decoded, so its count starts there. Also reported: each request's
mean gap between deltas while the whole batch streams (step_gaps), and total time over output
tokens (it includes the prefill).
Rounds alternate which side goes first.
"""

from __future__ import annotations

import asyncio
import statistics

import openai

from bench.agent.workload import LoopScript, StepRecord, _stream_chat

FORM_SCHEMA = {
    "type": "object",
    "properties": {k: {"type": "string", "minLength": 12, "maxLength": 20} for k in ("title", "owner", "place", "note")},
    "required": ["title", "owner", "place", "note"],
    "additionalProperties": False,
}
KINDS = ("tool_call", "json_schema")


def _request(kind: str, constrained: bool, script: LoopScript, tools: list[dict], index: int) -> dict:
    if kind == "tool_call":
        messages = [{"role": "system", "content": script.system}, {"role": "user", "content": script.task}]
        choice = {"tool_choice": "required", "parallel_tool_calls": False} if constrained else {"tool_choice": "none"}
        return {"messages": messages, "tools": tools, **choice}
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": FORM_SCHEMA,
                                                                      "strict": True}}} if constrained else {}
    return {"messages": [{"role": "user", "content": f"Fill in form {index}: {script.task}"}], **fmt}


async def _batch(client: openai.AsyncOpenAI, model: str, kind: str, constrained: bool, scripts: list[LoopScript],
                 tools: list[dict], max_tokens: int) -> list[StepRecord]:
    recs = [StepRecord(conversation=i, turn=0, delta_at_s=[]) for i in range(len(scripts))]
    await asyncio.gather(*(
        _stream_chat(client, rec, model=model, max_tokens=max_tokens, temperature=1.0, seed=i,
                     extra_body={"cache_salt": f"decode-{kind}-{i}", **({} if constrained else {"ignore_eos": True})},
                     **_request(kind, constrained, s, tools, i))
        for i, (s, rec) in enumerate(zip(scripts, recs))))
    return recs


def step_gaps(recs: list[StepRecord]) -> tuple[list[float], bool]:
    """Each request's mean gap between its deltas while every request of the batch streams (the
    span of its deltas in that window over their gaps); (means, True). When the batch never streams
    whole (a reply ended before another began), each request's mean over all its deltas; (means,
    False).

    A mean over a window, not the median of single gaps: deltas reach the client in bursts (two or
    three read at once, then a gap of as many steps; 19-58% of single gaps were under 2 ms), so the
    median of single gaps measured how the stream was read, not the step (-6% to +50% between runs).
    A delta that carries several tokens still counts as one gap: reported, not judged (headline).
    """
    times = [r.delta_at_s for r in recs if r.delta_at_s]
    if not times:
        return [], False
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    inside = [[x for x in t if start <= x <= end] for t in times]
    whole = all(len(t) >= 2 for t in inside)
    return [(t[-1] - t[0]) / (len(t) - 1) for t in (inside if whole else times) if len(t) >= 2], whole


def _per_token(recs: list[StepRecord]) -> dict:
    gaps, whole = step_gaps(recs)
    total = [r.total_s / r.completion_tokens for r in recs if r.completion_tokens]
    inter = [(r.total_s - r.ttft_s) / (r.completion_tokens - 1) for r in recs
             if r.ttft_s is not None and r.completion_tokens and r.completion_tokens > 1]
    return {"step_gap_s": gaps, "whole_batch": whole, "total_s_per_token": total, "inter_token_s": inter,
            "completion_tokens": [r.completion_tokens for r in recs],
            "finish_reasons": [r.finish_reason for r in recs]}


async def _measure(base_url: str, scripts: list[LoopScript], tools: list[dict], rounds: int, max_tokens: int,
                   timeout_s: float) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=timeout_s)
    out: dict = {k: {"on": [], "off": []} for k in KINDS}
    try:
        model = (await client.models.list()).data[0].id
        for kind in KINDS:
            for constrained in (True, False):  # warm-up: fills each prompt's cache, not recorded
                await _batch(client, model, kind, constrained, scripts, tools, max_tokens)
            for r in range(rounds):
                for constrained in ((True, False) if r % 2 == 0 else (False, True)):
                    recs = await _batch(client, model, kind, constrained, scripts, tools, max_tokens)
                    out[kind]["on" if constrained else "off"].append(_per_token(recs))
    finally:
        await client.close()
    return out


def _merged(rounds: list[dict], key: str) -> list[float]:
    return [x for r in rounds for x in r[key]]


def summarize(raw: dict) -> dict:
    """Per kind: medians per side and the grammar's extra cost per token (on / off - 1)."""
    out = {}
    for kind, sides in raw.items():
        rec: dict = {"rounds": sides}
        for key in ("step_gap_s", "total_s_per_token", "inter_token_s"):
            on, off = _merged(sides["on"], key), _merged(sides["off"], key)
            if on and off:
                rec[key] = {"on_median": statistics.median(on), "off_median": statistics.median(off),
                            "overhead": statistics.median(on) / statistics.median(off) - 1}
        rec["completion_tokens"] = {s: _merged(sides[s], "completion_tokens") for s in ("on", "off")}
        rec["whole_batch_rounds"] = {s: [r["whole_batch"] for r in sides[s]] for s in ("on", "off")}
        out[kind] = rec
    return out


def measure(base_url: str, scripts: list[LoopScript], tools: list[dict], rounds: int, max_tokens: int,
            timeout_s: float) -> dict:
    return summarize(asyncio.run(_measure(base_url, scripts, tools, rounds, max_tokens, timeout_s)))


def headline(decode: dict) -> dict:
    """The overhead compared to the target: each request's time per token after its first delta,
    grammar on over off. Tokens are the usage's count: a delta may carry several tokens' text
    (module docstring), which a gap between deltas cannot see, so the step gap is reported beside
    it but not judged."""
    out = {}
    for kind, rec in decode.items():
        if "inter_token_s" in rec:
            out[kind] = {"measure": "inter_token_s", "overhead": rec["inter_token_s"]["overhead"]}
    return out
