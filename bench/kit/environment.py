"""Facts about the machine that explain a number: CPU model and extensions, versions, load."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.kit.results import git_revision


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def _first_cpu() -> tuple[str | None, list[str]]:
    """The first processor's model name and flags in /proc/cpuinfo (None, [] where there is none)."""
    model, flags = None, []
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return model, flags
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags":
            flags = value.split()
            break
    return model, flags


def cpu_info() -> dict:
    """CPU model and the SIMD / matrix extensions that decide kernel speed (these machines vary)."""
    model, flags = _first_cpu()
    return {"model": model or platform.processor() or platform.machine(),
            "simd_flags": [f for f in SIMD_FLAGS if f in flags]}


def cpu_flags() -> dict:
    """CPU model and every vector / matrix flag by family (the serving benchmarks' record)."""
    model, flags = _first_cpu()
    wanted = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "bf16")
    return {"model": model, "flags": sorted(f for f in flags if f.startswith(wanted))}


def cpu_model() -> str:
    return _first_cpu()[0] or "unknown"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def environment_info() -> dict:
    """Facts that explain a number: interpreter, library versions, CPU, threads, load."""
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15m": list(os.getloadavg()),
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "git": git_revision(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info
