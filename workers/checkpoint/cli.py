"""`hybridserve make-model OUT --arch ... --preset ... --seed N`, as a pluggable subcommand."""

from __future__ import annotations

import argparse
from pathlib import Path

from workers.checkpoint.make_model import make_model
from workers.checkpoint.presets import Arch, Preset


def add_make_model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("out", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--arch", type=Arch, choices=list(Arch), default=Arch.BAMBA, metavar="{" + ",".join(a.value for a in Arch) + "}")
    parser.add_argument("--preset", type=Preset, choices=list(Preset), default=Preset.SMALL, metavar="{" + ",".join(p.value for p in Preset) + "}")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    return parser


def run_make_model(args: argparse.Namespace) -> Path:
    out = make_model(args.out, args.arch, args.preset, args.seed)
    print(f"wrote {args.arch.value}/{args.preset.value} (seed {args.seed}) checkpoint to {out}")
    return out
