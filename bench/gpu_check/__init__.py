"""`python -m bench.gpu_check [--smoke] [--device D] [--results-dir DIR]`: the engine on a GPU, in one run.

On the device it finds (CUDA if present; else the CPU, as a smoke), it checks and measures:

    logits.py        our logits == transformers' on the same device: Bamba, Granite 4.0-H and
                     Nemotron-H (bench presets) and the Granite / Nemotron MoE presets;
                     fp32 <= 1e-4, bf16 <= 1.5 x transformers' own bf16 error
    conversation.py  a conversation turn continued from its cached head == full recompute (fp32)
    prompt_logprobs.py  prompt logprobs (echo, lm-eval) == transformers' log_softmax, chunked prefill (fp32)
    determinism.py   deterministic requests bit-identical alone and under concurrent load (bf16)
    throughput.py    prefill / decode tokens/s vs transformers `generate` at c = 1, 8, 32 in bf16
                     on the bench preset scaled up to 0.91B parameters (plan.SPEED_SHAPE)
    plan.py          the full and smoke plans, the models (written by workers.checkpoint)
    report.py        Markdown and the pass/fail summary

Results: bench/results/gpu.{json,md} (a smoke: gpu.smoke.*), or --results-dir. The exit status
is 0 only when every check passed; a check that raises is a failure with its traceback in the
JSON, and the others still run.

On the GPU machine (torch 2.11 + CUDA 13, transformers 5.17, no network), from the repo root:

    python3 -m bench.gpu_check            # 154 s on one H200 (2026-11-27), model writing included

Carry transformers 5.23 (our pin): with the image's transformers 5.17 the Bamba and Granite 4.0-H
logit checks fail on the CPU as well (fp32 max error 2.2-2.6 against ours; Nemotron-H and its MoE
pass), a difference between those transformers versions, not a device one. Here, in the repo root:
`echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: -d .whl
transformers==5.23.0 huggingface_hub==2.4.0` (both pure Python), then on the GPU machine, with `.whl`
carried: `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
PYTHONPATH=/tmp/site python3 -m bench.gpu_check`. Otherwise the import chain is torch, transformers, safetensors, tokenizers,
jinja2, numpy, psutil, tqdm, pyyaml and the repo (proto.contract is plain Python). It imports
no ray, redis, grpc server, fastapi or pydantic; llguidance (grammars) is imported lazily
and unused here. Should a later import need a missing pure-Python wheel, carry it as
/work/.library/device/README.md says (`pip download --no-deps ... -d .whl NAME==VERSION`, carry
`.whl`, `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`, PYTHONPATH=/tmp/site).

What runs where: on CUDA the engine runs its pure-torch reference path (weights, KV and Mamba
caches, sampler inputs, deterministic tiles and grammar masks on the GPU; seeded draws on the
host); the C++ kernels, CPU flash attention and tuned/packed linears are CPU-only
(`workers.kernels.fast_path.runs_fast_path`), and int8 weight quantization is refused off the
CPU (EngineConfig raises ValueError).
"""
