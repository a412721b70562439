"""Run the deterministic requests under one background load in a fresh process; print JSON.

    python -m tests.determinism.scenario MODEL_DIR LOAD_SEED THREADS
"""

from __future__ import annotations

import json
import sys

import torch

from tests.determinism.helpers import DET_PROMPTS, background_load, det_arrivals, drive, new_engine


def main(model_dir: str, load_seed: int, threads: int) -> None:
    torch.set_num_threads(threads)
    outcome = drive(new_engine(model_dir), det_arrivals() + background_load(load_seed))
    print(json.dumps({"outcome": outcome.of(DET_PROMPTS), "unverified": outcome.unverified_streamed}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
