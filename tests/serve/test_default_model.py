"""With `model` empty (config.yaml's default) our engine's workers load the trained built-in
checkpoint shipped in the package (tests/engine/test_builtin_trained.py checks that it answers
"Hello!" in English and stops); the vLLM backend keeps its random GraniteMoeHybrid preset. No Ray:
the choice is a plain function of the settings."""

from __future__ import annotations

from pathlib import Path

import yaml

from deployments.settings import AppSettings, Backend
from deployments.worker.replica import model_dir_of
from workers.checkpoint.builtin import TRAINED_MODEL_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_config_yaml_serves_the_trained_builtin_model():
    (application,) = yaml.safe_load((ROOT / "config.yaml").read_text())["applications"]
    settings = AppSettings.model_validate(application["args"])
    assert settings.model == "" and settings.backend is Backend.OURS
    chosen = Path(model_dir_of(settings))
    assert chosen == TRAINED_MODEL_DIR and (chosen / "model.safetensors").is_file()
    assert (chosen / "training.json").is_file()


def test_an_explicit_model_wins(tmp_path):
    assert model_dir_of(AppSettings(model=str(tmp_path))) == str(tmp_path)
