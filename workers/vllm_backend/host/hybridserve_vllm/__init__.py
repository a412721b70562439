"""The part of hybridserve's vLLM backend that runs inside vLLM's environment (its own venv):
the engine host process and the KV connector it loads into vLLM. Nothing here imports our
package (it is not installed there): only the standard library, torch, vllm and llguidance.

    wire.py       frames between the worker replica and the engine host (also used on our side)
    heads.py      the heads this engine holds: committed and prepared, as block copies (our side
                  sizes prefix checkpoints with its LayerLayout)
    connector.py  vLLM's KV connector: loads a head before a request's forward, captures its end
    token_view.py llguidance's view of a tokenizer (as our grammar compiler builds it), given to vLLM's
                  guidance backend
    host.py       the engine host: vLLM's LLMEngine in this process, driven by the worker's frames
"""
