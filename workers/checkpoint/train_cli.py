"""The body of `hybridserve train-builtin OUT [--seed N] [--epochs E] [--max-steps S] ...`.

Options left out keep `TrainSettings`' defaults, which are what the shipped checkpoint was
trained with (its training.json records them).
"""

from __future__ import annotations

import argparse
import dataclasses

from workers.checkpoint.train_builtin import TrainResult, TrainSettings, train_builtin

_OPTIONS = ("seed", "epochs", "max_steps", "batch_tokens", "max_sequence", "threads")


def run_train_builtin(args: argparse.Namespace) -> TrainResult:
    given = {name: getattr(args, name) for name in _OPTIONS if getattr(args, name, None) is not None}
    settings = dataclasses.replace(TrainSettings(), **given)
    result = train_builtin(args.out, settings)
    print(
        f"trained {result.parameters:,} parameters in {result.steps} steps ({result.train_seconds:.0f} s): "
        f"held-out loss {result.held_out_loss:.3f} nats/token (unigram {result.unigram_held_out_loss:.3f}); "
        f"wrote {result.out_dir}"
    )
    return result
