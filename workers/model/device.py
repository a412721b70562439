"""Which devices the engine runs on, checked where the choice is made, not deep in a forward.

    cpu        every path: the fast path's C++ kernels, int8 weights, the reference
    cuda[:N]   the pure-torch reference path (weights, KV and Mamba caches, sampler inputs,
               deterministic tiles and grammar masks on the GPU); bf16 weights are its usual dtype
    other      (meta, mps, xpu, ...) refused: the engine has never run there

`parse_device` checks the name (EngineConfig does, on any host); `require_device` also checks
that the device is here (the loader does, before it reads any weight). `shape_stable_kernels`
is what every model forward on a GPU runs under.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

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


# SDPA backends without a per-shape set-up: cuDNN's is left out (see shape_stable_kernels).
_SHAPE_STABLE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def shape_stable_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """What a forward on `device` runs under: on CUDA, no cuDNN; elsewhere nothing changes.

    cuDNN builds an execution plan for each input shape it has not seen (the Mamba mixer's
    depthwise conv, an attention of a new length), and a server's steps bring new shapes all the
    time: every prompt length, every batch size, every split of a chunked prefill. On an H200
    the engine's first 32-prompt prefill ran at 6.9k tokens/s against 50k once its shapes were
    warm (bench/results/gpu.md). Without cuDNN the convs run on PyTorch's own depthwise kernel
    and attention on flash / memory-efficient / math SDPA, none of which sets up per shape.
    Both switches are process flags, set for the forward and restored after it (the engine
    thread is the only one that runs forwards); cuDNN's TF32 and determinism flags are kept."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    cudnn = torch.backends.cudnn
    stack = contextlib.ExitStack()
    stack.enter_context(cudnn.flags(enabled=False, benchmark=cudnn.benchmark,
                                    deterministic=cudnn.deterministic, allow_tf32=cudnn.allow_tf32))  # fmt: skip
    stack.enter_context(sdpa_kernel(_SHAPE_STABLE_SDPA))
    return stack
