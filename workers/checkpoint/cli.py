"""The body of `hybridserve make-model OUT --arch ... --preset ... [--moe] [--attention-head-dim D] --seed N`.

The arguments are declared in `workers/cli.py` without importing this package, so other
subcommands do not pay for importing transformers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workers.checkpoint.writer import make_model
from workers.checkpoint.presets import Arch, Preset


def run_make_model(args: argparse.Namespace) -> Path:
    arch, preset = Arch(args.arch), Preset(args.preset)
    moe = bool(getattr(args, "moe", False))
    out = make_model(args.out, arch, preset, args.seed, moe=moe,
                     attention_head_dim=getattr(args, "attention_head_dim", None))
    print(f"wrote {arch.value}/{preset.value}{' moe' if moe else ''} (seed {args.seed}) checkpoint to {out}")
    return out
