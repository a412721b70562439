"""Small random-weight Hugging Face checkpoints (Bamba, Granite 4.0-H, Nemotron-H) with a
character-level tokenizer and an append-consistent chat template: the built-in model for
demos, tests and CPU benchmarks.

    tokens.py          vocabulary layout and special token ids
    chat_template.py   the Jinja chat template
    tokenizer.py       builds / writes the tokenizer files
    presets.py         Arch / Preset enums and architecture-neutral ModelShapes
    configs.py         ModelShape -> transformers config
    random_config.py   varied tiny configs for tests
    weights.py         random weights that make a useful test model
    metadata.py        hybridserve.json (eos and never-sample ids)
    make_model.py      writes a checkpoint directory
    cli.py             the `make-model` subcommand
"""

from workers.checkpoint.chat_template import CHAT_TEMPLATE, GENERATION_PROMPT, Role
from workers.checkpoint.cli import run_make_model
from workers.checkpoint.configs import build_config
from workers.checkpoint.make_model import build_random_model, make_model
from workers.checkpoint.metadata import METADATA_FILE, ServingMetadata
from workers.checkpoint.presets import Arch, ModelShape, PositionEmbedding, Preset, preset_shape
from workers.checkpoint.random_config import random_tiny_config, random_tiny_shape
from workers.checkpoint.tokenizer import build_tokenizer, write_tokenizer
from workers.checkpoint.tokens import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    NEVER_SAMPLE_TOKEN_IDS,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    SpecialToken,
)

__all__ = [
    "Arch",
    "BOS_TOKEN_ID",
    "CHAT_TEMPLATE",
    "EOS_TOKEN_ID",
    "GENERATION_PROMPT",
    "METADATA_FILE",
    "ModelShape",
    "NEVER_SAMPLE_TOKEN_IDS",
    "PAD_TOKEN_ID",
    "PositionEmbedding",
    "Preset",
    "Role",
    "ServingMetadata",
    "SpecialToken",
    "VOCAB_SIZE",
    "build_config",
    "build_random_model",
    "build_tokenizer",
    "make_model",
    "preset_shape",
    "random_tiny_config",
    "random_tiny_shape",
    "run_make_model",
    "write_tokenizer",
]
