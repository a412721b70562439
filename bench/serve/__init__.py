"""Serving benchmark: `python -m bench.serve [--quick] [--skip-vllm] [--skip-app]`.

(`--backend vllm`: the workload below on our app with its workers on vLLM's engine, against
vLLM's server and our app on our engine, on a dense and an MoE checkpoint: bench/serve/vllm_backend.py.)

N concurrent conversations x T turns over HTTP with the official `openai` client (streamed,
greedy, `stream_options.include_usage`), on the GraniteMoeHybrid `bench` checkpoint (random
weights, made in a temp dir), against, one at a time on an otherwise idle benchmark:

  (a) our app with the conversation cache: `serve run` of config.yaml (2 Worker replicas,
      1 torch thread each, the cache service and its embedded Redis started by the app);
      each turn sends only the new user message with `conversation_id` + `cache_salt`;
  (b) the same running app without reuse: stateless requests carrying the full history, each
      with a cache_salt of its own (a stateless request reuses the longest prefix held under
      its salt, so a shared salt would no longer measure recomputing the history);
  (c) vLLM's OpenAI server on its CPU build (`python -m vllm.entrypoints.openai.api_server`)
      with its defaults (prefix caching on), full history each turn. Its engine is expected
      to die on the first long chat (the failure is caught and recorded), so also
  (d) vLLM with `--no-enable-prefix-caching`.
  vLLM needs `--gpu-memory-utilization` lowered on this machine (it reserves that fraction
  of the NUMA node's memory and refuses to start when less is free), and `--dtype float32`:
  with `auto` it downcasts our fp32 checkpoint to its CPU platform's first dtype, bf16, which
  is emulated (slow) on CPUs without native bf16, while our app serves fp32; otherwise
  default flags.

Per turn: TTFT p50/p99 over the conversations (time to the first streamed content), prompt
tokens, `usage.prompt_tokens_details.cached_tokens`; per mode: output tokens/s (all
completion tokens / wall time), cache hit ratio (cached / prompt tokens).

Serving overhead: TTFT of a cached turn at a ~500-token history through HTTP (ingress,
sticky router, worker, cache-service gRPC: lease, publish) over the TTFT of the same turn in
an in-process engine (`LLMEngine` + `ConversationCache`, the worker's engine configuration,
stepped synchronously), median of K conversations each way, one request in flight, HTTP and
in-process samples alternating (the app idles while the in-process engine runs).

Order: our app first, then vLLM; each mode's workload has a wall-time budget, turns not
finished within it are reported as cut off (vLLM's CPU engine slows down badly when the
machine is oversubscribed: its OpenMP threads spin).

Then the prefix-reuse workloads of ordinary OpenAI clients, each side by side on the same app
and vLLM servers (bench/serve/prefix.py: multi-turn stateless clients with a round barrier, and
new conversations over a shared system prompt). A vLLM server whose engine died is started
again before the next workload (not in --smoke), so each workload records how far it gets.

Targets: (a) TTFT p50 >= 5x lower than (b) and than vLLM at the last turn of a >=2k-token
conversation; overhead <= 1.3x at a 500-token history.
Writes bench/results/serve.{json,md,png} (the quick run: serve.quick.*; --smoke, the tiny
checkpoint and one short conversation: serve.smoke.*; --results-dir elsewhere).
`--model DIR` serves that checkpoint instead of the random preset (the built-in trained one, or a
random-weight copy of it, to see that trained weights leave the timings alone).
"""
