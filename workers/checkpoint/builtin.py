"""The built-in default model: the `small` Bamba checkpoint, written on first use (the vLLM
backend's: the `small` GraniteMoeHybrid one, a family vLLM runs).

Nothing can be downloaded at run time, so the default model is generated locally (random
weights, deterministic for the seed) and kept in a cache directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Plain names, not the enums: importing workers.checkpoint pulls in transformers, which
# only writing the model (once) needs.
BUILTIN_ARCH, BUILTIN_PRESET, BUILTIN_SEED = "bamba", "small", 0
VLLM_BUILTIN_ARCH = "granitemoehybrid"
# Bumped whenever the presets or the weight initialisation change, so a stale cached copy
# is never mistaken for the current built-in model.
BUILTIN_VERSION = 2  # 2: the chat template renders tools


def model_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridserve" / "models"


def builtin_model_dir(root: Path | None = None, arch: str = BUILTIN_ARCH) -> Path:
    """Path of the built-in model (of `arch`), writing it first if it is not there yet."""
    name = f"{arch}-{BUILTIN_PRESET}-seed{BUILTIN_SEED}-v{BUILTIN_VERSION}"
    out = (root or model_cache_root()) / name
    if not (out / "model.safetensors").is_file():
        from workers.checkpoint.writer import make_model

        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        make_model(tmp, arch, BUILTIN_PRESET, BUILTIN_SEED)
        try:
            tmp.replace(out)  # atomic: a concurrent first run sees all of it or nothing
        except OSError:  # another process published it first
            shutil.rmtree(tmp, ignore_errors=True)
    return out
