"""The frames between a worker and its engine host (no vLLM needed)."""

from __future__ import annotations

import io

from workers.vllm_backend.host.hybridserve_vllm import wire


def test_frames_carry_their_message_and_lengths_past_4_gib():
    message = {"op": "reply", "call": 7, "value": [b"\x00\x01" * 1000, {"tokens": 12}]}
    stream = io.BytesIO(wire.encode(message) + wire.encode({"op": "out"}))
    assert wire.read(stream) == message
    assert wire.read(stream) == {"op": "out"}
    assert wire.read(stream) is None
    # A long conversation's head on a large model exports more than 4 GiB in one frame.
    assert wire.body_length(wire.header(5 << 30)) == 5 << 30
