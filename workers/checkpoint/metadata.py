"""`hybridserve.json`: what the engine needs to know about a checkpoint beyond config.json.

    {
      "format_version": 1,
      "eos_token_ids": [2],                      # end of turn: stop and commit
      "never_sample_token_ids": [0, 1, 3, ...],  # logits masked to -inf before sampling
      "vocab_size": 104
    }

Checkpoints without this file (real Hugging Face models) fall back to the eos ids of
generation_config.json / config.json and mask nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

METADATA_FILE = "hybridserve.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ServingMetadata:
    eos_token_ids: tuple[int, ...]
    never_sample_token_ids: tuple[int, ...]
    vocab_size: int

    def __post_init__(self) -> None:
        if set(self.eos_token_ids) & set(self.never_sample_token_ids):
            raise ValueError("an eos token can't also be never-sampled: turns could never end")
        if any(not 0 <= i < self.vocab_size for i in self.eos_token_ids + self.never_sample_token_ids):
            raise ValueError("token id outside the vocabulary")

    def write(self, checkpoint_dir: str | Path) -> Path:
        path = Path(checkpoint_dir) / METADATA_FILE
        body = {
            "format_version": FORMAT_VERSION,
            "eos_token_ids": list(self.eos_token_ids),
            "never_sample_token_ids": list(self.never_sample_token_ids),
            "vocab_size": self.vocab_size,
        }
        path.write_text(json.dumps(body, indent=2) + "\n")
        return path

    @classmethod
    def read(cls, checkpoint_dir: str | Path) -> ServingMetadata | None:
        """None when the checkpoint has no hybridserve.json."""
        path = Path(checkpoint_dir) / METADATA_FILE
        if not path.exists():
            return None
        body = json.loads(path.read_text())
        if body.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: unsupported format_version {body.get('format_version')!r}")
        return cls(
            eos_token_ids=tuple(body["eos_token_ids"]),
            never_sample_token_ids=tuple(body["never_sample_token_ids"]),
            vocab_size=int(body["vocab_size"]),
        )
