"""The neutral contract: stable names and digests, and a model identity that changes with
everything that makes a head's bits differ (weights, config, dtype and weight quantization, torch,
device kind)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from proto.contract import (
    ConversationRef,
    ModelIdentity,
    chunk_digest,
    conversation_key,
    message_prefix_digests,
    tokens_digest,
)
from workers.checkpoint import Arch
from workers.config import WeightQuantization
from workers.identity import model_identity

NONE = WeightQuantization.NONE


def test_names_and_digests_are_stable():
    # Golden values: the cache service stored these in Redis; changing them orphans every key.
    assert conversation_key("conv", "salt") == "518a83ae18387ba364a12601cd01f3ee"
    assert conversation_key("conv", "salt") != conversation_key("convs", "alt")  # no re-splitting
    assert tokens_digest([1, 2, 3]) == "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d"
    assert chunk_digest(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_message_prefix_names_chain_and_never_cross_scopes():
    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    both = message_prefix_digests("salt", [system, user])
    assert both == ["bc9046173d7c0f25bff90ddf8a83445d", "a65265ec3f5c9dc533bf73a1ffe3df01"]  # stored in Redis
    assert message_prefix_digests("salt", [system]) == both[:1]  # a prefix names the same
    assert message_prefix_digests("other", [system, user])[0] != both[0]  # another scope: other names
    # Framed: moving text across the role/content or message boundary gives another name.
    assert message_prefix_digests("salt", [{"role": "system", "content": "be brie"}, user])[0] != both[0]
    assert message_prefix_digests("salt", [{"role": "systemb", "content": "e brief"}])[0] != both[0]
    assert message_prefix_digests("salt", [{"role": "user", "content": "hi"}, system])[1] != both[1]


def test_a_conversation_ref_is_named_by_its_id_and_salt():
    ref = ConversationRef("conv", "salt")
    assert ref.key == conversation_key("conv", "salt")
    assert ref == ConversationRef("conv", "salt") and len({ref, ConversationRef("conv", "salt")}) == 1
    assert ConversationRef("conv", "other") != ref  # another salt: another conversation
    assert ConversationRef("conv", "other").key != ref.key
    assert ref.fork("conv2") == ConversationRef("conv2", "salt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.salt = "other"  # a ref never changes under its key


def test_model_identity_covers_weights_config_dtype_and_machine(tiny, tmp_path):
    path = tiny[Arch.BAMBA].path
    base = model_identity(path, torch.float32, "cpu", NONE)
    assert base == model_identity(path, torch.float32, "cpu", NONE)
    assert base.torch_version == torch.__version__ and base.device_kind.startswith("cpu:")
    assert model_identity(path, torch.bfloat16, "cpu", NONE) != base
    assert model_identity(path, torch.float32, "cpu", WeightQuantization.INT8) != base
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("}", ' , "extra": 1}', 1))
    assert model_identity(copy, torch.float32, "cpu", NONE).config_digest != base.config_digest
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_identity(copy, torch.float32, "cpu", NONE).weights_digest != base.weights_digest
    for field in dataclasses.fields(ModelIdentity):
        other = dataclasses.replace(base, **{field.name: "x"})
        assert other.digest != base.digest and ModelIdentity.from_dict(other.to_dict()) == other
