"""The checkpoint a benchmark measures: a given directory, or a random one made once per preset."""

from __future__ import annotations

import tempfile
from pathlib import Path

from workers.checkpoint import Arch, Preset, make_model


def checkpoint_dir(arch: Arch, preset: Preset, seed: int, model_dir: Path | None) -> Path:
    """The checkpoint (deterministic in arch, preset, seed), written once outside the repo."""
    out = model_dir or Path(tempfile.gettempdir()) / "hybridserve-bench" / f"{arch.value}-{preset.value}-seed{seed}"
    if not (out / "model.safetensors").exists() or not (out / "hybridserve.json").exists():
        make_model(out, arch, preset, seed)
    return out
