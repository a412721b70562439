"""What one run checks and measures: the plan (full on a GPU, smoke on a CPU), the device, the models.

    logit models   the bench preset of each family (tiny for a smoke) and the two MoE presets
    speed model    the bench preset of Granite 4.0-H scaled up (`SPEED_SHAPE`, 0.91B parameters):
                   hidden 2048, 16 layers (1 attention : 3 Mamba2), 16 query / 4 KV heads,
                   MLP 5632, Mamba heads of 64 with d_state 128; a smoke uses the tiny preset
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.checkpoint import Arch, Preset, make_model, make_model_of_shape, preset_shape

# (name, arch, mixture of experts): every family's dense preset, then the MoE presets.
LOGIT_MODELS = (
    ("bamba", Arch.BAMBA, False),
    ("granite", Arch.GRANITEMOEHYBRID, False),
    ("nemotron", Arch.NEMOTRON_H, False),
    ("granite-moe", Arch.GRANITEMOEHYBRID, True),
    ("nemotron-moe", Arch.NEMOTRON_H, True),
)
SPEED_ARCH = Arch.GRANITEMOEHYBRID
SPEED_SHAPE = dataclasses.replace(
    preset_shape(SPEED_ARCH, Preset.BENCH),
    hidden_size=2048,
    layer_pattern="MMM*" * 4,
    num_attention_heads=16,
    num_key_value_heads=4,
    mlp_intermediate_size=5632,
    initializer_range=2048**-0.5,
)


@dataclass(frozen=True)
class Plan:
    smoke: bool
    logit_preset: Preset
    logit_prompt: int  # tokens of the prompt whose logits are compared (the last few decoded)
    turns: int  # conversation turns before the checked one
    reply_tokens: int
    det_requests: int  # deterministic requests, each alone and then among the load
    det_load: int  # ordinary requests running beside them
    det_tokens: int
    concurrency: tuple[int, ...]
    prompt_len: int
    new_tokens: int


FULL = Plan(False, Preset.BENCH, 300, 2, 24, 4, 28, 96, (1, 8, 32), 512, 64)
SMOKE = Plan(True, Preset.TINY, 40, 1, 8, 2, 3, 20, (1, 2), 16, 4)


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def exact_fp32(device: torch.device) -> None:
    """fp32 means fp32 on the GPU too: no TF32 in matmuls or cuDNN convolutions (the Mamba conv),
    which would make fp32 logits differ by ~1e-3 from any reference."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


class Models:
    """The logit models, each written on first use (inside the check that needs it: a family the
    installed transformers cannot build fails its own checks, not the run)."""

    def __init__(self, root: Path, plan: Plan):
        self.root, self.preset = root, plan.logit_preset
        self._paths: dict[str, Path] = {}

    def path(self, name: str) -> Path:
        if name not in self._paths:
            arch, moe = next((arch, moe) for n, arch, moe in LOGIT_MODELS if n == name)
            self._paths[name] = make_model(self.root / name, arch, self.preset, seed=1, moe=moe)
        return self._paths[name]


def write_speed_model(root: Path, plan: Plan) -> Path:
    if plan.smoke:
        return make_model(root / "speed", SPEED_ARCH, Preset.TINY, seed=2)
    return make_model_of_shape(root / "speed", SPEED_ARCH, SPEED_SHAPE, seed=2)


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total
