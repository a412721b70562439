"""The fused CPU decode kernels (`csrc/decode_kernels.cpp`), built from source on first use.

Torch's extension mechanism compiles them with the machine's own compiler; the build is
cached per CPU (model and instruction-set flags) and torch version, so a checkout shared by
different machines never runs code built for another CPU. When the build cannot happen (no
compiler, no ninja, a non-CPU device), `decode_kernels()` returns None and the model runs its
pure-torch reference path, which is always there and which the tests compare against.

    kernels = decode_kernels()          # the module, or None (reason in `build_failure()`)
    kernels.conv_step(conv_cache, slots, xbc, weight, bias)            -> silu(conv) [B, C]
    kernels.ssm_step(ssm_cache, slots, x, dt_raw, dt_bias, A, B, C, D, dt_min, dt_max) -> y [B, H, P]
    kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, num_keys, scale) -> [B, Hq, d]
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_kernels.cpp"
_failure: str | None = None


def cpu_signature() -> str:
    """CPU model and instruction-set flags (Linux /proc/cpuinfo; the platform string elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '?')}|{fields.get('flags', '')}"


def _build_dir() -> Path:
    key = hashlib.sha256(f"{cpu_signature()}|{torch.__version__}|{SOURCE.read_bytes()!r}".encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "hybridserve" / "kernels" / key


@functools.cache
def decode_kernels() -> ModuleType | None:
    """The compiled kernels, or None when they cannot be built here (logged once)."""
    global _failure
    _put_pip_ninja_on_path()
    if shutil.which("ninja") is None or shutil.which("c++") is None:
        _failure = "no ninja or c++ on PATH"
    else:
        try:
            from torch.utils.cpp_extension import load

            out = _build_dir()
            out.mkdir(parents=True, exist_ok=True)
            return load(
                name="hybridserve_decode_kernels",
                sources=[str(SOURCE)],
                build_directory=str(out),
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except (OSError, RuntimeError, ImportError, SystemExit) as e:  # compiler or linker failures
            _failure = f"{type(e).__name__}: {e}"
    log.warning("fused decode kernels unavailable (%s); using the pure-torch path", _failure)
    return None


def _put_pip_ninja_on_path() -> None:
    """The `ninja` wheel (a dependency) installs its binary next to the venv's interpreter, which
    is not on PATH when the venv is not activated; torch's builder looks for it on PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def build_failure() -> str | None:
    """Why `decode_kernels()` returned None, if it did."""
    return _failure
