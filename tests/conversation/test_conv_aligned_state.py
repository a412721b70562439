"""A committed head holds the exact state at its committed length and, in its second Mamba
slot, the state at the last aligned position (deterministic mode restarts tiles there):

    committed tokens  t0 ........................ t(state_len-1) tn   (tn sampled, never fed)
    head KV           positions [0, state_len)
    head slot 0       Mamba state after t(state_len-1)
    head slot 1       Mamba state after t(aligned_len-1),  aligned_len = state_len // align * align

Each is compared with a fresh stateless prefill of exactly those tokens (one-shot, so it only
agrees within float tolerance with the cached turns' chunked prefills and decodes).
"""

from __future__ import annotations

import pytest
import torch

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    BLOCK,
    assert_state_close,
    check_turn_against_reference,
    conversation,
    greedy,
    head_of,
    new_cache,
    new_engine,
    prefill_state,
    reference_prompt,
    snapshot,
    user,
)
from workers.checkpoint import Arch

# Tokens left in the head's tail block after each turn (0: block-aligned committed length).
TAILS = [5, 0, 3]


def max_tokens_for_tail(engine, cc, messages, tail: int, align: int) -> int:
    history = cc.describe(ConversationRef("c1", "s"))["messages"] if conversation(cc, "c1", "s") else []
    n = len(reference_prompt(engine, history, messages))
    return next(m for m in range(4, 4 + align) if (n + m - 1) % align == tail)


@pytest.mark.parametrize(
    "arch,align",
    [(Arch.BAMBA, BLOCK), (Arch.GRANITEMOEHYBRID, BLOCK), (Arch.NEMOTRON_H, BLOCK), (Arch.BAMBA, 2 * BLOCK)],
    ids=["bamba", "granitemoehybrid", "nemotron_h", "bamba-align16"],
)
def test_head_states_equal_fresh_prefill(models, reference_engines, arch, align):
    ref = reference_engines[arch]
    eng = new_engine(models[arch], mamba_align_tokens=align if align != BLOCK else 0)
    cc = new_cache(eng)
    for turn, tail in enumerate(TAILS, start=1):
        messages = user(f"turn {turn}, tail {tail}")
        m = max_tokens_for_tail(eng, cc, messages, tail, align)
        check_turn_against_reference(cc, ref, "c1", "s", messages, greedy(m), f"t{turn}")
        head = head_of(cc, "c1", "s")
        ids = cc.describe(ConversationRef("c1", "s"))["token_ids"]
        assert head.state_len == len(ids) - 1 and head.state_len % align == tail
        assert head.aligned_len == head.state_len // align * align > 0

        ours = snapshot(eng, head.holder)
        terminal = prefill_state(ref, ids[: head.state_len])
        assert_state_close(ours, terminal, num_tokens=head.state_len, slot=0)
        aligned = prefill_state(ref, ids[: head.aligned_len])
        assert_state_close(ours, aligned, num_tokens=head.aligned_len, slot=1)
        if tail == 0:  # snapshot taken at the very end: the same state, bit for bit
            for t in ours.conv + ours.ssm:
                assert torch.equal(t[0], t[1])
        else:  # and distinguishable, or this test would not tell the two slots apart
            assert not torch.allclose(terminal.ssm[0][0], aligned.ssm[0][0], atol=1e-3)
