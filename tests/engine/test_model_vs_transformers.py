"""Our model == transformers' full-sequence forward, for the three families and varied shapes.

Logits of every position are compared (scaled by the reference's std); the shapes cover
n_groups > 1, MHA / GQA / MQA, attention as first and as last layer, RoPE and NoPE, and
prompt lengths on both sides of the KV block size (16) and the Mamba chunk sizes (8/16/32).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import (
    GREEDY,
    assert_logits_close,
    hf_greedy,
    hf_logits,
    new_engine,
    our_logits,
    prompt_of,
    write_checkpoint,
)
from workers.checkpoint import Arch, PositionEmbedding, random_tiny_config
from workers.model.config import MixerKind

# (id, arch, random shape seed or None for the tiny preset, shape overrides)
SHAPES = [
    ("bamba-tiny-attn-first", Arch.BAMBA, None, {}),
    ("bamba-mqa-attn-last-g4-c8", Arch.BAMBA, None,
     dict(layer_pattern="M*MM*", num_key_value_heads=1, mamba_n_groups=4, mamba_chunk_size=8)),
    ("bamba-random", Arch.BAMBA, 5, {}),
    ("granite-tiny-attn-last", Arch.GRANITEMOEHYBRID, None, {}),
    ("granite-nope-mha-attn-first", Arch.GRANITEMOEHYBRID, None,
     dict(layer_pattern="*M*M", num_key_value_heads=4, mamba_n_groups=1, mamba_chunk_size=8,
          position_embedding=PositionEmbedding.NOPE)),
    ("granite-random", Arch.GRANITEMOEHYBRID, 7, {}),
    ("nemotron-tiny-attn-last", Arch.NEMOTRON_H, None, {}),
    ("nemotron-mqa-attn-first-g8", Arch.NEMOTRON_H, None,
     dict(layer_pattern="*M-M", num_key_value_heads=1, mamba_n_groups=8, mamba_chunk_size=32)),
    ("nemotron-random", Arch.NEMOTRON_H, 11, {}),
]
PROMPT_LENGTHS = [1, 7, 8, 9, 16, 17, 33, 47]


@pytest.fixture(scope="module", params=SHAPES, ids=[s[0] for s in SHAPES])
def shape_ckpt(request, tmp_path_factory):
    name, arch, seed, overrides = request.param
    config = random_tiny_config(arch, seed=seed, **overrides)
    return write_checkpoint(tmp_path_factory.mktemp(name), config, seed=3)


def test_shapes_cover_what_they_claim(tiny):
    """The shape list really has the variety the tests rely on (guards against preset edits)."""
    seen = {"attn_first": False, "attn_last": False, "groups>1": False, "mqa": False, "gqa": False}
    for _, arch, seed, overrides in SHAPES:
        config = random_tiny_config(arch, seed=seed, **overrides)
        from workers.model.config import parse_hf_config

        ours = parse_hf_config(config.to_dict())
        seen["attn_first"] |= ours.blocks[0].mixer is MixerKind.ATTENTION
        seen["attn_last"] |= ours.blocks[-1].mixer is MixerKind.ATTENTION
        seen["groups>1"] |= ours.mamba.n_groups > 1
        seen["mqa"] |= ours.attention.n_kv_heads == 1
        seen["gqa"] |= 1 < ours.attention.n_kv_heads < ours.attention.n_heads
    assert all(seen.values()), seen


def test_logits_match_transformers_full_forward(shape_ckpt):
    model = shape_ckpt.ours
    for length in PROMPT_LENGTHS:
        ids = prompt_of(length, seed=length)
        ref = hf_logits(shape_ckpt, ids)
        assert_logits_close(our_logits(model, ids), ref)


def test_logits_match_with_small_blocks(shape_ckpt):
    """Block size 3 (not a divisor of anything) and a block table out of order."""
    ids = prompt_of(29, seed=1)
    assert_logits_close(our_logits(shape_ckpt.ours, ids, block_size=3), hf_logits(shape_ckpt, ids))


def test_reference_is_sensitive(shape_ckpt):
    """A model that ignored its context would pass the tests above trivially: check it does not."""
    a, b = prompt_of(20, seed=1), prompt_of(20, seed=2)
    b[-1] = a[-1]
    la, lb = hf_logits(shape_ckpt, a)[-1], hf_logits(shape_ckpt, b)[-1]
    assert float(((la - lb) / la.std()).abs().max()) > 100 * 1e-4


@pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
def test_engine_greedy_matches_transformers(tiny, arch):
    ckpt = tiny[arch]
    engine = new_engine(ckpt.path)
    prompts = [prompt_of(n, seed=n) for n in (1, 16, 21)]
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert [t.token_id for t in out] == hf_greedy(ckpt, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
def test_engine_decode_logits_match_transformers(tiny, arch):
    """Every logits row the engine sampled from (prefill, then each decode) equals the row of
    transformers' full forward over prompt + generated tokens at that position."""
    from tests.engine.conftest import LogitRecorder, run_engine

    ckpt = tiny[arch]
    engine = new_engine(ckpt.path)
    recorder = LogitRecorder(engine)
    prompt = prompt_of(30, seed=4)
    run = run_engine(engine, {"a": prompt})
    full = prompt + run.tokens["a"]
    ref = hf_logits(ckpt, full[:-1])[len(prompt) - 1 :]
    assert_logits_close(recorder.stacked("a"), ref)


def test_loader_fuses_in_checkpoint_order(tiny):
    """q/k/v and gate/up are concatenated in the order the loader documents."""
    ckpt = tiny[Arch.BAMBA]
    hf_layer = ckpt.hf.model.layers[0]
    ours = ckpt.ours.blocks[0]
    expected = torch.cat([hf_layer.self_attn.q_proj.weight, hf_layer.self_attn.k_proj.weight,
                          hf_layer.self_attn.v_proj.weight])
    assert torch.equal(ours.mixer.qkv.weight, expected)
    up = torch.cat([hf_layer.feed_forward.gate_proj.weight, hf_layer.feed_forward.up_proj.weight])
    assert torch.equal(ours.ffn.up.weight, up)
