"""This engine's `proto.contract.ModelIdentity`: what a foreign head's state must match."""

from __future__ import annotations

import hashlib
import platform
from functools import lru_cache
from pathlib import Path

import torch

from proto.contract import ModelIdentity
from workers.config import WeightQuantization


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


@lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: the architecture alone names the CPU kind
    return platform.processor() or "unknown"


def device_kind(device: str) -> str:
    """The hardware class whose kernels produce the bits: the CPU model, or the GPU's name."""
    if device.startswith("cuda"):
        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    return f"{device}:{platform.machine()}:{_cpu_model()}"


def model_identity(
    model_dir: Path | str, dtype: torch.dtype, device: str, weight_quantization: WeightQuantization
) -> ModelIdentity:
    """A weight quantization is part of the dtype: int8 weights compute other states than fp32
    ones, so heads never move between engines that differ in it."""
    model_dir = Path(model_dir)
    return ModelIdentity(
        weights_digest=_file_digest(sorted(model_dir.glob("*.safetensors"))),
        config_digest=_file_digest([model_dir / "config.json"]),
        dtype=str(dtype) if weight_quantization is WeightQuantization.NONE else f"{dtype}/{weight_quantization.value} weights",
        torch_version=torch.__version__,
        device_kind=device_kind(device),
    )
