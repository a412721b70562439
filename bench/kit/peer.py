"""Drives `bench/vllm_peer.py` in the vLLM venv: one subprocess per model, kept alive so its runs
alternate with ours in one invocation.

    with VllmPeer(model_dir, threads=2, max_model_len=4096) as peer:
        reply = peer.generate(prompts, new_tokens)   # phases, CPU times, output token ids
        peer.info()                                  # vLLM version and the settings it ran with

Families vLLM runs: GraniteMoeHybrid and NemotronH (it dropped Bamba in 0.23).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from workers.vllm_backend.venv import ensure_vllm_python, vllm_env
from workers.checkpoint import Arch

PEER_SCRIPT = Path(__file__).resolve().parent / "vllm_peer.py"
VLLM_ARCHS = (Arch.GRANITEMOEHYBRID, Arch.NEMOTRON_H)


class PeerError(RuntimeError):
    """The vLLM subprocess failed to start or to answer a command (its traceback attached)."""


class VllmPeer:
    def __init__(
        self,
        model_dir: Path,
        threads: int,
        max_model_len: int,
        prefix_caching: bool = False,
        kv_cache_mib: int = 1024,
    ):
        self.log_path = Path(tempfile.gettempdir()) / f"hybridserve-vllm-peer-{model_dir.name}.log"
        command = [
            str(ensure_vllm_python()), str(PEER_SCRIPT), "--model", str(model_dir),
            "--max-model-len", str(max_model_len), "--kv-cache-mib", str(kv_cache_mib),
        ]  # fmt: skip
        if prefix_caching:
            command.append("--prefix-caching")
        env = vllm_env(threads) | {"OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        ready = self._read()
        if not ready.get("ready"):
            self.close()
            raise PeerError(f"vLLM did not start (log: {self.log_path}):\n{ready.get('error', ready)}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"vLLM exited with {self.proc.wait()} (log: {self.log_path})")
        return json.loads(line)

    def _call(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise PeerError(reply["error"])
        return reply

    def generate(self, prompts: list[list[int]], new_tokens: int, suppress: tuple[int, ...] = ()) -> dict:
        """`suppress`: ids vLLM must never sample (our engine's never-sampled control ids)."""
        return self._call({"op": "generate", "prompts": prompts, "new_tokens": new_tokens, "suppress": list(suppress)})

    def info(self) -> dict:
        return self._call({"op": "info"})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def vllm_runs(arch: Arch) -> bool:
    return arch in VLLM_ARCHS


if __name__ == "__main__":  # a smoke check: python -m bench.kit.peer MODEL_DIR
    with VllmPeer(Path(sys.argv[1]), threads=2, max_model_len=1024) as p:
        print(p.info(), p.generate([[10, 11, 12]], 4)["outputs"])
