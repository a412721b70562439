"""The built-in default model: the `small` Bamba checkpoint, written on first use.

Nothing can be downloaded at run time, so the default model is generated locally (random
weights, deterministic for the seed) and kept in a cache directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from workers.checkpoint.make_model import make_model
from workers.checkpoint.presets import Arch, Preset

BUILTIN_ARCH, BUILTIN_PRESET, BUILTIN_SEED = Arch.BAMBA, Preset.SMALL, 0


def model_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridserve" / "models"


def builtin_model_dir(root: Path | None = None) -> Path:
    """Path of the built-in model, writing it first if it is not there yet."""
    out = (root or model_cache_root()) / f"{BUILTIN_ARCH.value}-{BUILTIN_PRESET.value}-seed{BUILTIN_SEED}"
    if not (out / "model.safetensors").is_file():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        make_model(tmp, BUILTIN_ARCH, BUILTIN_PRESET, BUILTIN_SEED)
        tmp.replace(out) if not out.exists() else None
    return out
