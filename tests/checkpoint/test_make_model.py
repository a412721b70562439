"""make_model: HF-native checkpoints that load offline, deterministic in the seed."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.cli import build_parser
from workers.checkpoint import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    METADATA_FILE,
    NEVER_SAMPLE_TOKEN_IDS,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    Arch,
    Preset,
    ServingMetadata,
    make_model,
    run_make_model,
)

_MODEL_TYPE = {Arch.BAMBA: "bamba", Arch.GRANITEMOEHYBRID: "granitemoehybrid", Arch.NEMOTRON_H: "nemotron_h"}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_model(root / arch.value, arch, Preset.TINY, seed=0) for arch in Arch}


def _load(path):
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tok


@pytest.mark.parametrize("arch", list(Arch))
def test_checkpoint_files_and_ids(tiny_dirs, arch):
    path = tiny_dirs[arch]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == _MODEL_TYPE[arch]
    assert config["vocab_size"] == VOCAB_SIZE
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (
        PAD_TOKEN_ID,
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
    )
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == EOS_TOKEN_ID
    meta = ServingMetadata.read(path)
    assert meta == ServingMetadata((EOS_TOKEN_ID,), NEVER_SAMPLE_TOKEN_IDS, VOCAB_SIZE)
    assert json.loads((path / METADATA_FILE).read_text())["never_sample_token_ids"] == [0, 1, 3, 4, 5, 103]


@pytest.mark.parametrize("arch", list(Arch))
def test_loads_offline_and_generates(tiny_dirs, arch):
    model, tok = _load(tiny_dirs[arch])
    assert type(model).__name__.lower().startswith(_MODEL_TYPE[arch].replace("_", ""))
    assert model.dtype == torch.float32
    assert len(tok) == model.config.vocab_size
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a cat and a dog, please."}],
        add_generation_prompt=True,
        return_tensors="pt",
    )["input_ids"]
    assert prompt.shape[1] > model.config.to_dict().get("mamba_chunk_size", model.config.to_dict().get("chunk_size"))
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            suppress_tokens=list(NEVER_SAMPLE_TOKEN_IDS),
        )
    generated = out[0, prompt.shape[1] :].tolist()
    assert len(generated) == 20
    assert len(set(generated)) > 1
    assert not set(generated) & set(NEVER_SAMPLE_TOKEN_IDS)


@pytest.mark.parametrize("arch", list(Arch))
def test_same_seed_same_bytes_other_seed_other_bytes(tiny_dirs, tmp_path, arch):
    again = make_model(tmp_path / "again", arch, Preset.TINY, seed=0)
    other = make_model(tmp_path / "other", arch, Preset.TINY, seed=1)
    reference = (tiny_dirs[arch] / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == reference
    assert (other / "model.safetensors").read_bytes() != reference
    assert (other / "config.json").read_text() == (tiny_dirs[arch] / "config.json").read_text()


def test_no_constant_vectors_left(tiny_dirs):
    """Norm weights, biases, D, dt_bias, A_log all vary, so head/layer mix-ups are visible."""
    model, _ = _load(tiny_dirs[Arch.NEMOTRON_H])
    for name, param in model.named_parameters():
        if param.dim() == 1 and param.numel() > 1:
            assert param.std() > 0, name


def test_cli_hook(tmp_path):
    parser = build_parser()
    args = parser.parse_args(
        ["make-model", str(tmp_path / "m"), "--arch", "granitemoehybrid", "--preset", "tiny", "--seed", "7"]
    )
    assert (Arch(args.arch), Preset(args.preset), args.seed) == (Arch.GRANITEMOEHYBRID, Preset.TINY, 7)
    out = run_make_model(args)
    assert json.loads((out / "config.json").read_text())["model_type"] == "granitemoehybrid"
    with pytest.raises(SystemExit):
        parser.parse_args(["make-model", str(tmp_path), "--arch", "llama"])
