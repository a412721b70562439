"""n > 1: a turn's choices other than its own (choice 0, the one committed or checkpointed),
as the worker streams them: deltas under their index, then how each ended (a ChoiceEnd the
turn's TurnDone carries)."""

from __future__ import annotations

from typing import Any

from deployments.messages import ChoiceEnd, TokenLogprob, TurnDelta
from deployments.tool_replies import ReplyCalls
from workers.request import FinishReason


class OtherChoice:
    def __init__(self, index: int, calls: ReplyCalls):
        self.index = index
        self.calls = calls  # its own tool calls, named apart from choice 0's
        self.completion_tokens = 0
        self.end: ChoiceEnd | None = None

    def events(self, out: Any, logprobs: tuple[TokenLogprob, ...] | None) -> list[TurnDelta]:
        """The deltas of one engine output of this choice (a RequestOutput); its end once finished."""
        self.completion_tokens += len(out.new_tokens)
        events = []
        text, call_deltas = self.calls.feed(out.text_delta)
        if out.new_tokens or text or call_deltas:
            events.append(TurnDelta(text, tuple(out.new_token_ids), logprobs, call_deltas, index=self.index))
        if not out.finished:
            return events
        text, call_deltas = self.calls.finish()
        if text or call_deltas:
            events.append(TurnDelta(text, (), None, call_deltas, index=self.index))
        reason = out.finish_reason.value
        if self.calls.calls and out.finish_reason is FinishReason.STOP:
            reason = "tool_calls"
        self.end = ChoiceEnd(self.index, reason, self.completion_tokens, self.calls.calls)
        return events
