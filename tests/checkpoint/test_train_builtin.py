"""`hybridserve train-builtin` on a budget of two short steps a stage: it writes a checkpoint our loader,
engine and transformers load, that records its corpus, and the same seed gives the same bytes.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.checkpoint.dialogue_corpus import CORPUS_LICENSE, CORPUS_PACKAGE, corpus_version
from workers.checkpoint.metadata import ServingMetadata
from workers.checkpoint.tokens import EOS_TOKEN_ID
from workers.checkpoint.train_builtin import TRAINING_FILE, TrainSettings, answer_mask, train_builtin
from workers.cli import main
from workers.model.config import ModelFamily
from workers.model.loader import load_model

TINY_BUDGET = TrainSettings(max_steps=2, batch_tokens=256, max_sequence=64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "model"
    argv = ["train-builtin", str(out), "--max-steps", "2", "--batch-tokens", "256", "--max-sequence", "64"]
    assert main(argv) == 0
    return out


def test_writes_a_checkpoint_both_loaders_read(trained):
    ours = load_model(trained)
    assert ours.config.family is ModelFamily.GRANITE_MOE_HYBRID
    hf = AutoModelForCausalLM.from_pretrained(trained, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(trained, local_files_only=True)
    assert hf.config.vocab_size == len(tokenizer) == TrainSettings().vocab_size
    assert tokenizer.eos_token_id == EOS_TOKEN_ID and tokenizer.chat_template
    meta = ServingMetadata.read(trained)
    assert meta.eos_token_ids == (EOS_TOKEN_ID,) and meta.vocab_size == hf.config.vocab_size
    assert tokenizer.convert_ids_to_tokens(list(meta.never_sample_token_ids)) == [
        "<|pad|>", "<|bos|>", "<|unk|>", "<|start_of_role|>", "<|end_of_role|>", "<|reserved_0|>"]


def test_records_corpus_settings_and_losses(trained):
    record = json.loads((trained / TRAINING_FILE).read_text())
    assert record["corpus"]["package"] == CORPUS_PACKAGE and record["corpus"]["version"] == corpus_version()
    assert record["corpus"]["license"] == CORPUS_LICENSE
    assert record["settings"] == {**TrainSettings().__dict__, **TINY_BUDGET.__dict__}
    assert record["result"]["steps"] == 4  # two stages (all tokens, then answers only) of two steps
    assert record["result"]["held_out_loss"] > 0 and record["result"]["unigram_held_out_loss"] > 0


def test_same_seed_same_weights(trained, tmp_path):
    again = train_builtin(tmp_path / "again", TINY_BUDGET, progress=False).out_dir
    assert (again / "model.safetensors").read_bytes() == (trained / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (trained / "tokenizer.json").read_bytes()


def test_answer_tuning_scores_the_assistants_replies_only():
    header = [4, 90, 5]  # <|start_of_role|> assistant <|end_of_role|>
    seq = [4, 80, 5, 11, 12, 2, 4, 90, 5, 21, 22, 2, 4, 80, 5, 13, 2, 4, 90, 5, 23]
    assert [t for t, keep in zip(seq, answer_mask(seq, header)) if keep] == [21, 22, 2, 23]
