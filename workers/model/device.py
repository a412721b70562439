"""Which devices the engine runs on, checked where the choice is made, not deep in a forward.

    cpu        every path: the fast path's C++ kernels, int8 weights, the reference
    cuda[:N]   the pure-torch reference path (weights, KV and Mamba caches, sampler inputs,
               deterministic tiles and grammar masks on the GPU); bf16 weights are its usual dtype
    other      (meta, mps, xpu, ...) refused: the engine has never run there

`parse_device` checks the name (EngineConfig does, on any host); `require_device` also checks
that the device is here (the loader does, before it reads any weight).
"""

from __future__ import annotations

import torch

ENGINE_DEVICE_TYPES = ("cpu", "cuda")


class DeviceUnavailableError(RuntimeError):
    """The engine was configured for a device this host does not have."""


def parse_device(name: str | torch.device) -> torch.device:
    """`name` as a torch.device, or ValueError saying what the engine runs on."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {name!r} is not a device name: use cpu or cuda[:N]") from e
    if device.type not in ENGINE_DEVICE_TYPES:
        raise ValueError(f"device {name!r} is not supported: the engine runs on cpu or cuda[:N]")
    return device


def require_device(name: str | torch.device) -> torch.device:
    """`parse_device`, and the device must exist on this host."""
    device = parse_device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device {name!r}: torch {torch.__version__} sees no CUDA device here")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceUnavailableError(f"device {name!r}: this host has {count} CUDA device(s)")
    return device
