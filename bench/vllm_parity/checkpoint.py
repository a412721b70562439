"""The checkpoint both servers run (bench.vllm_parity's docstring says why this one)."""

from __future__ import annotations

import json
from pathlib import Path

from workers.checkpoint import Arch, Preset, make_model
from workers.checkpoint.chat_template import CHAT_TEMPLATE

# The built-in template, opened by a variable of the render when the request gives it (as
# Granite's own templates take `thinking`): what chat_template_kwargs reaches.
GREETING_TEMPLATE = "{%- if greeting is defined -%}{{- 'greeting:' + greeting -}}{%- endif -%}" + CHAT_TEMPLATE


def make_parity_model(directory: Path, seed: int = 4) -> Path:
    model_dir = make_model(directory, Arch.GRANITEMOEHYBRID, Preset.TINY, seed=seed, attention_head_dim=32)
    (model_dir / "chat_template.jinja").write_text(GREETING_TEMPLATE)
    return model_dir


def never_sampled(model_dir: Path) -> set[int]:
    """The control ids our engine never samples (hybridserve.json)."""
    return set(json.loads((Path(model_dir) / "hybridserve.json").read_text())["never_sample_token_ids"])


def vocab_size(model_dir: Path) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
