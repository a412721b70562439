"""vLLM-CPU side of the benchmarks: a long-lived subprocess in the vLLM venv, driven by JSON lines.

Run by `bench.kit.peer.VllmPeer` with the venv's interpreter (this file imports nothing of ours:
our package is not on that venv's path). The model loads once; each command line on stdin
gets one result line on the protocol pipe. vLLM logs to stdout, so the protocol uses a
duplicate of the original stdout and fd 1 is pointed at stderr.

    -> {"op": "generate", "prompts": [[ids...], ...], "new_tokens": N, "suppress": [ids...]}
    <- {"prefill_s", "decode_s", "prefill_cpu_s", "decode_cpu_s", "decode_tokens", "outputs": [[ids...]]}
    -> {"op": "info"}          <- {"vllm": version, "settings": {...}}
    -> {"op": "quit"}

Phases are cut exactly as on our side: t0 = requests added, t_first = every sequence has its
first token (between engine steps), t_end = all done. The ids in `suppress` (our engine's
never-sampled control ids) are never sampled: every other id of the vocabulary is allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

# Run as a script, this file's folder is sys.path[0]: a module of ours there (e.g. one named
# like a package transformers probes for, such as `kernels`) would shadow the venv's own.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


class Peer:
    def __init__(self, args: argparse.Namespace):
        from vllm import LLM

        self.settings = {
            "model": args.model,
            "dtype": "float32",
            "max_model_len": args.max_model_len,
            "enable_prefix_caching": args.prefix_caching,
            "max_num_seqs": args.max_num_seqs,
            # An explicit KV budget: the default reserves 92% of the NUMA node's memory.
            "kv_cache_memory_bytes": args.kv_cache_mib << 20,
            "seed": 0,
        }
        self.llm = LLM(**self.settings)
        self.engine = self.llm.llm_engine
        self._next = 0

    def generate(self, prompts: list[list[int]], new_tokens: int, suppress: list[int]) -> dict:
        from vllm import SamplingParams

        banned = set(suppress)
        allowed = [i for i in range(self.engine.model_config.get_vocab_size()) if i not in banned] if banned else None
        params = SamplingParams(
            temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, allowed_token_ids=allowed
        )
        ids = [f"peer-{self._next + i}" for i in range(len(prompts))]
        self._next += len(prompts)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        first = None
        produced_before_first = 0
        t0 = _clock()
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            if first is None and all(tokens[rid] for rid in ids):
                first = _clock()
                produced_before_first = sum(len(t) for t in tokens.values())
        end = _clock()
        outputs = [tokens[rid] for rid in ids]
        generated = sum(len(t) for t in outputs)
        return {
            "prefill_s": first[0] - t0[0],
            "prefill_cpu_s": first[1] - t0[1],
            "decode_s": end[0] - first[0],
            "decode_cpu_s": end[1] - first[1],
            "generated_tokens": generated,
            "decode_tokens": generated - produced_before_first,
            "outputs": outputs,
        }

    def info(self) -> dict:
        import vllm

        return {"vllm": vllm.__version__, "settings": self.settings}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--prefix-caching", action="store_true")
    args = parser.parse_args()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        peer = Peer(args)
    except Exception:
        proto.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        raise
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "quit":
                break
            if command["op"] == "info":
                reply = peer.info()
            else:
                reply = peer.generate(command["prompts"], command["new_tokens"], command.get("suppress", []))
        except Exception:
            reply = {"error": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
