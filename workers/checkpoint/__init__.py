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
    writer.py          writes a checkpoint directory (make_model, make_model_of_shape)
    cli.py             the `make-model` subcommand
"""

import importlib
from typing import Any

# Names resolve lazily (PEP 562): most of them pull in transformers, which the engine's
# serving path never needs.
_EXPORTS = {
    "CHAT_TEMPLATE": "chat_template",
    "GENERATION_PROMPT": "chat_template",
    "Role": "chat_template",
    "run_make_model": "cli",
    "build_config": "configs",
    "build_random_model": "writer",
    "make_model": "writer",
    "make_model_of_shape": "writer",
    "METADATA_FILE": "metadata",
    "ServingMetadata": "metadata",
    "Arch": "presets",
    "ModelShape": "presets",
    "MoeShape": "presets",
    "PositionEmbedding": "presets",
    "Preset": "presets",
    "preset_shape": "presets",
    "random_tiny_config": "random_config",
    "random_tiny_shape": "random_config",
    "build_tokenizer": "tokenizer",
    "write_tokenizer": "tokenizer",
    "BOS_TOKEN_ID": "tokens",
    "EOS_TOKEN_ID": "tokens",
    "NEVER_SAMPLE_TOKEN_IDS": "tokens",
    "PAD_TOKEN_ID": "tokens",
    "VOCAB_SIZE": "tokens",
    "SpecialToken": "tokens",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
