"""A reply's tool calls, read out of its text as it streams (the worker's side).

The engine streams text; the chat template's tool-call form (workers/tools/formats.py) says
which of it is content and which are calls. Each call gets an id here, in its first delta, and
the whole calls come with the turn's end. Ids are named by the turn's publish name and the
call's index: a turn answered again from the ledger (an idempotent retry, a lost replica's
committed turn) gives its calls the ids the client may have seen already.
"""

from __future__ import annotations

import hashlib

from deployments.messages import ToolCall, ToolCallDelta
from workers.tools.formats import ParsedPiece, ToolFormat


def call_id(turn_name: str, index: int) -> str:
    return "call_" + hashlib.sha256(f"{turn_name}\x00{index}".encode()).hexdigest()[:24]


class ReplyCalls:
    """`form` None: the request parses no calls (no tools, or tool_choice "none"): all content."""

    def __init__(self, form: ToolFormat | None, turn_name: str):
        self.form = form
        self.turn_name = turn_name
        self._parser = form.parser() if form is not None else None
        self.calls: tuple[ToolCall, ...] = ()
        self.content = ""

    def feed(self, text: str) -> tuple[str, tuple[ToolCallDelta, ...]]:
        if self._parser is None:
            self.content += text
            return text, ()
        return self._deltas(self._parser.feed(text))

    def finish(self) -> tuple[str, tuple[ToolCallDelta, ...]]:
        """The content held back till the end, and the whole calls in `calls`."""
        if self._parser is None:
            return "", ()
        tail = self._deltas(self._parser.finish())
        parsed = self._parser.calls
        self.calls = tuple(ToolCall(call_id(self.turn_name, i), c.name, c.arguments) for i, c in enumerate(parsed))
        return tail

    def _deltas(self, piece: ParsedPiece) -> tuple[str, tuple[ToolCallDelta, ...]]:
        self.content += piece.content
        deltas = []
        for index, name, arguments in piece.calls:
            if name:  # a call's first piece
                deltas.append(ToolCallDelta(index, call_id(self.turn_name, index), name, arguments))
            else:
                deltas.append(ToolCallDelta(index, arguments=arguments))
        return piece.content, tuple(deltas)

    def reply_message(self) -> dict:
        """The assistant message as the client sends it back (what the prefix index names)."""
        message: dict = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        return message
