"""Response ids and the Responses API's bodies: the Response object and its SSE events.

A response id names one committed turn, decodable without storage:

    resp_ + base64url(JSON [conversation id, turn, publish id])      (stored)
    resp_ + base64url(JSON [null, 0, publish id])                    (store=false: nothing to find)

It carries no cache_salt or API key: it is read under the caller's scope, so another scope finds
no such conversation. The publish id (the turn's request id, which the ledger entry keeps) tells
the turn from a later one that took its place (after a DELETE rewound the conversation).

Streamed events, each with its `sequence_number`:

    response.created  response.in_progress
    [message]   output_item.added  content_part.added  output_text.delta*
                output_text.done  content_part.done  output_item.done
    [call]*     output_item.added  function_call_arguments.delta*  .done  output_item.done
    response.completed | response.incomplete (max_output_tokens) | error + response.failed
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from deployments.front.chat_models import MAX_ID_BYTES
from deployments.errors import APIError
from deployments.front.extensions import served_by
from deployments.messages import ToolCall, TurnDelta, TurnDone

PREFIX = "resp_"
# The publish ids a committed turn can have: a Responses API turn's, a chat completion's (its
# request id), an idempotent chat completion's (turn/outcome.IdempotencyKey). A chat completion's
# conversation turn is a stored response too: its body carries the id (chat_format.py).
PUBLISH_PREFIXES = ("resp-", "chatcmpl-", "idem-")
MAX_TURN = (1 << 32) - 1  # the ledger's turn numbers are uint32
# The longest id one of ours can be: base64 of [a conversation id of MAX_ID_BYTES (JSON may escape
# each byte as six characters), a turn, a publish id]. Longer text is nobody's id, and is not decoded.
MAX_RESPONSE_ID = len(PREFIX) + 4 * (6 * MAX_ID_BYTES + 512) // 3


@dataclass(frozen=True)
class ResponseId:
    conversation_id: str | None  # None: not stored
    turn: int
    publish_id: str

    @staticmethod
    def new_publish_id() -> str:
        return f"resp-{uuid.uuid4().hex}"

    def __str__(self) -> str:
        raw = json.dumps([self.conversation_id, self.turn, self.publish_id], separators=(",", ":"))
        return PREFIX + base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    @classmethod
    def parse(cls, text: str) -> "ResponseId | None":
        """None when `text` is no stored response's id."""
        if not text.startswith(PREFIX) or len(text) > MAX_RESPONSE_ID:
            return None
        body = text[len(PREFIX):]
        try:
            conv, turn, publish = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        except (binascii.Error, ValueError, TypeError, UnicodeDecodeError, RecursionError):  # nested [[[...]]]
            return None
        if not (isinstance(conv, str) and isinstance(turn, int) and not isinstance(turn, bool)
                and 1 <= turn <= MAX_TURN and isinstance(publish, str) and publish.startswith(PUBLISH_PREFIXES)):
            return None
        try:
            size = len(conv.encode())
        except UnicodeEncodeError:  # JSON may carry lone surrogates
            return None
        return cls(conv, turn, publish) if 0 < size <= MAX_ID_BYTES else None


def not_found(response_id: str) -> APIError:
    return APIError(404, f"no response {response_id!r} under this cache_salt", "response_not_found")


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


@dataclass
class ResponseBody:
    """The Response object of one request: its id, the request's echo, and what the turn gave."""

    rid: ResponseId
    model: str
    echo: dict[str, Any]
    previous_response_id: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return str(self.rid)

    @property
    def conversation_id(self) -> str | None:
        return self.rid.conversation_id

    @property
    def _key(self) -> str:  # the items' ids: named by the turn's publish id, as its tool calls' are
        return self.rid.publish_id.removeprefix("resp-")[-24:]

    @property
    def message_id(self) -> str:
        return f"msg_{self._key}"

    def call_id(self, index: int) -> str:
        return f"fc_{self._key}_{index}"

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def call(self, index: int, call: ToolCall, status: str) -> dict[str, Any]:
        return {"id": self.call_id(index), "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": status}

    def output(self, text: str, calls: tuple[ToolCall, ...], finish_reason: str) -> list[dict[str, Any]]:
        status = "incomplete" if finish_reason == "length" else "completed"
        items = [self.message(text, status)] if text or not calls else []
        return items + [self.call(i, c, status) for i, c in enumerate(calls)]

    def body(self, status: str, output: list, *, usage_: dict | None = None, error: dict | None = None,
             incomplete: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
                "error": error, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "model": self.model, "output": output, "usage": usage_,
                "previous_response_id": self.previous_response_id,
                "conversation": {"id": self.conversation_id} if self.conversation_id else None,
                **self.echo}

    def finished(self, text: str, calls: tuple[ToolCall, ...], finish_reason: str, prompt: int, completion: int,
                 cached: int) -> dict[str, Any]:
        incomplete = finish_reason == "length"
        return self.body("incomplete" if incomplete else "completed", self.output(text, calls, finish_reason),
                         usage_=usage(prompt, completion, cached), incomplete=incomplete)

    def done(self, text: str, done: TurnDone) -> dict[str, Any]:
        body = self.finished(text, done.tool_calls, done.finish_reason, done.prompt_tokens, done.completion_tokens,
                             done.cached_tokens)
        return {**body, "hybridserve": served_by(done)}


def sse(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ResponseStream:
    """The SSE events of one response, from the turn's events. The message item opens at the
    first text, a function_call item at its call's first delta; the final response carries the
    same items (same ids) as a non-streamed one."""

    def __init__(self, body: ResponseBody):
        self.response, self.seq = body, 0
        self.text: list[str] = []
        self.items: list[str] = []  # the kinds of the items opened, by output_index
        self._message_open = False
        self._calls: dict[int, dict[str, Any]] = {}  # open calls by their index: output_index, arguments

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(payload)

    def start(self) -> Iterator[str]:
        body = self.response.body("in_progress", [])
        yield self._event("response.created", response=body)
        yield self._event("response.in_progress", response=body)

    def delta(self, delta: TurnDelta) -> Iterator[str]:
        if delta.text:
            if not self._message_open and "message" not in self.items:
                yield from self._open_message()
            self.text.append(delta.text)
            if self._message_open:  # text after a tool call's start joins the message, told at the end
                yield self._event("response.output_text.delta", item_id=self.response.message_id,
                                  output_index=self.items.index("message"), content_index=0, delta=delta.text,
                                  logprobs=[])
        for piece in delta.tool_calls:
            call = self._calls.get(piece.index)
            if call is None:
                yield from self._close_message()
                call = self._calls[piece.index] = {"output_index": len(self.items), "id": piece.id,
                                                   "name": piece.name, "arguments": ""}
                self.items.append("function_call")
                item = self.response.call(piece.index, ToolCall(piece.id, piece.name, ""), "in_progress")
                yield self._event("response.output_item.added", output_index=call["output_index"], item=item)
            if piece.arguments:
                call["arguments"] += piece.arguments
                yield self._event("response.function_call_arguments.delta", item_id=self.response.call_id(piece.index),
                                  output_index=call["output_index"], delta=piece.arguments)

    def _open_message(self) -> Iterator[str]:
        self._message_open = True
        self.items.append("message")
        index = len(self.items) - 1
        item = self.response.message("", "in_progress")
        item["content"] = []
        yield self._event("response.output_item.added", output_index=index, item=item)
        yield self._event("response.content_part.added", item_id=self.response.message_id, output_index=index,
                          content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                 "logprobs": []})

    def _close_message(self, status: str = "completed") -> Iterator[str]:
        if not self._message_open:
            return
        self._message_open = False
        index, text = self.items.index("message"), "".join(self.text)
        item = self.response.message(text, status)
        yield self._event("response.output_text.done", item_id=self.response.message_id, output_index=index,
                          content_index=0, text=text, logprobs=[])
        yield self._event("response.content_part.done", item_id=self.response.message_id, output_index=index,
                          content_index=0, part=item["content"][0])
        yield self._event("response.output_item.done", output_index=index, item=item)

    def end(self, done: TurnDone) -> Iterator[str]:
        status = "incomplete" if done.finish_reason == "length" else "completed"
        if not self.items and not done.tool_calls:
            yield from self._open_message()  # an empty reply is still a message, as when not streamed
        yield from self._close_message(status)
        for index, call in enumerate(done.tool_calls):
            opened = self._calls.get(index)
            if opened is None:  # streamed whole at the end, or not at all: announced now
                opened = self._calls[index] = {"output_index": len(self.items)}
                self.items.append("function_call")
                item = self.response.call(index, ToolCall(call.id, call.name, ""), "in_progress")
                yield self._event("response.output_item.added", output_index=opened["output_index"], item=item)
            yield self._event("response.function_call_arguments.done", item_id=self.response.call_id(index),
                              output_index=opened["output_index"], arguments=call.arguments)
            yield self._event("response.output_item.done", output_index=opened["output_index"],
                              item=self.response.call(index, call, status))
        final = self.response.done("".join(self.text), done)
        yield self._event("response.incomplete" if status == "incomplete" else "response.completed", response=final)

    def error(self, error: APIError) -> Iterator[str]:
        """Our error (its code as in a JSON error body), then the failed response, whose code is
        one of OpenAI's few: invalid_prompt for a 400, server_error otherwise."""
        yield self._event("error", code=error.code, message=error.message, param=error.param)
        code = "invalid_prompt" if error.status == 400 else "server_error"
        failed = self.response.body("failed", [], error={"code": code, "message": error.message})
        yield self._event("response.failed", response=failed)
