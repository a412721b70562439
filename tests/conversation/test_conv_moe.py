"""A conversation on a mixture-of-experts model (Granite 4.0-H MoE): each turn through the
conversation cache == the same turn sent stateless with the whole history."""

from __future__ import annotations

from tests.conversation.helpers import check_turn_against_reference, conversation, greedy, new_cache, new_engine, user
from workers.checkpoint import Arch, Preset, make_model


def test_cached_turns_equal_stateless_turns_on_moe(tmp_path):
    model = make_model(tmp_path / "moe", Arch.GRANITEMOEHYBRID, Preset.TINY, seed=2, moe=True)
    cc, ref = new_cache(new_engine(model)), new_engine(model, max_num_batched_tokens=512)
    for turn, (text, max_tokens) in enumerate([("hi", 9), ("Tell me more.", 12), ("Why?", 7)]):
        result = check_turn_against_reference(cc, ref, "c1", "s", user(text), greedy(max_tokens), f"t{turn}")
        if turn:
            assert result.num_cached_tokens > 0  # the turn resumed from the cached head
    assert conversation(cc, "c1", "s").turn == 3
