"""The built-in models.

The default model (`default_model_dir`, what the app and `hybridserve generate` load when no
model is given) is the trained one shipped inside the package: a small Granite 4.0-H trained on
English dialogue by `hybridserve train-builtin` (`train_builtin.py`), a family our engine and
vLLM both run, so both backends default to it.

The random-weight presets stay for tests and benchmarks that need exact families and sizes:
`builtin_model_dir` writes the `small` one of an architecture on first use (random weights,
deterministic for the seed) into a cache directory. Nothing is downloaded at run time.
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


TRAINED_MODEL_DIR = Path(__file__).resolve().parent / "builtin_trained"


def default_model_dir() -> Path:
    """The trained built-in checkpoint shipped with the package."""
    if not (TRAINED_MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the trained built-in model is missing from {TRAINED_MODEL_DIR}: reinstall the package, "
            f"or write it with `hybridserve train-builtin {TRAINED_MODEL_DIR}`"
        )
    return TRAINED_MODEL_DIR


def model_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridserve" / "models"


def builtin_model_dir(root: Path | None = None, arch: str = BUILTIN_ARCH) -> Path:
    """Path of the random-weight `small` model of `arch`, writing it first if it is not there yet."""
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
