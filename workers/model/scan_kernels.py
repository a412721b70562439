"""The Mamba2 prefill scan kernel (`csrc/ssd_scan.cpp`), built from source on first use.

Built like `workers.model.kernels` (torch's extension mechanism, the machine's own compiler
with -march=native, cached per CPU signature, torch version and source), as its own module so
that each kernel file builds, and fails, on its own. When it cannot be built, `scan_kernels()`
returns None and the prefill runs the pure-torch SSD scan (`ssd.chunked_scan_grouped`).

    ext = scan_kernels()            # the module, or None (reason in `build_failure()`)
    y, final = ext.recurrent_scan(x, dt, A, B, C, initial_state)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
from pathlib import Path
from types import ModuleType

import torch

from workers.model.kernels import _put_pip_ninja_on_path, cpu_signature

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "ssd_scan.cpp"
_failure: str | None = None


def _build_dir() -> Path:
    key = hashlib.sha256(f"{cpu_signature()}|{torch.__version__}|{SOURCE.read_bytes()!r}".encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "hybridserve" / "kernels" / f"scan-{key}"


@functools.cache
def scan_kernels() -> ModuleType | None:
    """The compiled kernel, or None when it cannot be built here (logged once)."""
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
                name="hybridserve_ssd_scan",
                sources=[str(SOURCE)],
                build_directory=str(out),
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except (OSError, RuntimeError, ImportError, SystemExit) as e:  # compiler or linker failures
            _failure = f"{type(e).__name__}: {e}"
    log.warning("prefill scan kernel unavailable (%s); using the pure-torch SSD scan", _failure)
    return None


def build_failure() -> str | None:
    """Why `scan_kernels()` returned None, if it did."""
    return _failure
