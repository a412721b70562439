"""The engine's device choice: what runs where, and refusals that say why, made where the choice
is made (no CUDA is needed: these run on any host).

    cpu        the fast path (C++ kernels, CPU flash attention, tuned linears) or the reference
    cuda[:N]   the pure-torch reference path; int8 weights refused
    other      refused by EngineConfig ("meta", "mps", typos)
"""

from __future__ import annotations

import pytest
import torch

from workers.config import EngineConfig, WeightQuantization
from workers.kernels.fast_path import runs_fast_path
from workers.model.device import DeviceUnavailableError, parse_device, require_device, shape_stable_kernels
from workers.model.loader import load_model
from workers.sampling import SamplingParams, sample

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("name", ["meta", "mps", "xpu", "gpu", "cuda:x", ""])
def test_a_device_the_engine_never_ran_on_is_refused_by_the_config(name):
    with pytest.raises(ValueError, match="cpu or cuda"):
        EngineConfig(model="m", device=name)


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:3"])
def test_cpu_and_cuda_are_accepted_by_the_config_on_any_host(name):
    assert EngineConfig(model="m", device=name, dtype=torch.bfloat16).device == name
    assert parse_device(name).type in ("cpu", "cuda")


def test_int8_weights_are_refused_off_the_cpu():
    with pytest.raises(ValueError, match="fp32 CPU engines only"):
        EngineConfig(model="m", device="cuda", weight_quantization=WeightQuantization.INT8)


def test_the_fast_path_is_selected_on_the_cpu_only():
    assert runs_fast_path("cpu") and runs_fast_path(torch.device("cpu"))
    assert not runs_fast_path("cpu", enabled=False)
    assert not runs_fast_path("cuda") and not runs_fast_path("cuda:1")


def _kernel_flags() -> tuple[bool, ...]:
    cuda = torch.backends.cuda
    return (torch.backends.cudnn.enabled, cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(),
            cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled())  # fmt: skip


def test_a_cuda_forward_runs_without_cudnn_and_puts_the_flags_back():
    """cuDNN sets up a plan per new shape (hundreds of ms on an H200: bench/results/gpu.md); a
    forward on CUDA runs without it, and leaves the process's flags as it found them. The flags
    are process state, so this runs on any host; the CPU's forward changes nothing."""
    before, tf32 = _kernel_flags(), torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # what bench.gpu_check asks for exact fp32
    try:
        with shape_stable_kernels(torch.device("cuda")):
            assert _kernel_flags() == (False, False, True, True, True)
            assert torch.backends.cudnn.allow_tf32 is False
        assert _kernel_flags() == before
        with shape_stable_kernels(torch.device("cpu")):
            assert _kernel_flags() == before
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.skipif(not NO_CUDA, reason="this host has CUDA")
def test_cuda_without_a_gpu_fails_before_any_weight_is_read(tmp_path):
    with pytest.raises(DeviceUnavailableError, match="no CUDA device"):
        require_device("cuda")
    # the loader checks first: the directory is not even read (it holds no checkpoint)
    with pytest.raises(DeviceUnavailableError, match="no CUDA device"):
        load_model(tmp_path, torch.bfloat16, "cuda")


def test_host_masks_and_banned_ids_apply_to_logits_wherever_they_are():
    """The sampler takes grammar masks and banned ids made on the host, and draws seeded tokens
    on the host: on the CPU, the same tokens as before (moves are no-ops)."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [1.0, 0.5, 0.2, 4.0]])
    banned = torch.tensor([1])
    mask = torch.tensor([True, True, True, False])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)]
    out = sample(logits, params, [5, 5], banned, allowed=[None, mask])
    assert out[0].token_id == 2  # 1 is banned
    assert out[1].token_id != 3  # the mask forbids 3
    again = sample(logits, params, [5, 5], banned, allowed=[None, mask])
    assert [t.token_id for t in again] == [t.token_id for t in out]
