"""With `model` empty (config.yaml's default) our engine's workers load the trained built-in
checkpoint shipped in the package (tests/engine/test_builtin_trained.py checks that it answers
"Hello!" in English and stops); the vLLM backend keeps its random GraniteMoeHybrid preset. The
choice is a plain function of the settings; the last test asks an app on that default (the
`builtin` fixture) over HTTP, as a client of `serve run config.yaml` would."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.settings import AppSettings, Backend
from deployments.worker.replica import model_dir_of
from workers.checkpoint.builtin import TRAINED_MODEL_DIR
from workers.checkpoint.dialogue_corpus import load_conversations, vocabulary, words_of

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


@pytest.mark.timeout(300)
async def test_the_default_model_answers_hello_greedily_in_corpus_words(builtin):
    """What a first `serve run config.yaml` user sees: a short reply, every word of it a word of
    the training conversations, that ends by itself (a random model runs to max_tokens)."""
    reply = await builtin.client().chat.completions.create(
        model=builtin.model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=64, temperature=0)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens < 64, text
    words = words_of(text)
    assert words and set(words) <= vocabulary(load_conversations()), text
