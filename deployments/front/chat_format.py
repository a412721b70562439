"""The OpenAI chat-completion bodies of one turn: the JSON answer and the SSE chunks.

    non-streaming:  {"object": "chat.completion", choices: [message], usage}
    streaming:      data: chunk(role)  data: chunk(delta)*  data: chunk(finish_reason)
                    [data: chunk([], usage)]  data: [DONE]
    conversation turns add "conversation_id" to every body, and "turn" and "response_id" (the
    turn as the Responses API names it: `previous_response_id` forks from it) once the turn is done;
    the body that ends a turn (the last chunk before [DONE] in a stream) adds "hybridserve":
    {"replica", "cached_from", "recovery"} (served_by below).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from deployments.errors import APIError
from deployments.front.extensions import served_by
from deployments.front.responses_format import ResponseId
from deployments.front.prompt_logprobs import vllm_prompt_logprobs
from deployments.messages import ChoiceEnd, PromptLogprob, TokenLogprob, ToolCall, ToolCallDelta, TurnDelta, TurnDone

SSE_DONE = "data: [DONE]\n\n"


def data(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage_of(done: TurnDone) -> dict:
    """The prompt once, the completion tokens of every choice (n > 1) summed, as OpenAI's."""
    completion = done.all_completion_tokens
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": completion,
            "total_tokens": done.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def choice_ends(done: TurnDone) -> list[ChoiceEnd]:
    """How each choice ended, by index: choice 0's is the turn's own."""
    return [ChoiceEnd(0, done.finish_reason, done.completion_tokens, done.tool_calls), *done.others]


def logprobs_of(entries: Iterable[TokenLogprob] | None) -> dict:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top]}
                        for e in entries or ()]}


def tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's chunk shape: the first piece of a call carries its id, type and name."""
    if delta.id:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


@dataclass(frozen=True)
class ChatFormat:
    """The bodies of one chat completion (request id, model, conversation, logprobs wanted, and
    the publish id the turn is committed under: its response id's last part)."""

    request_id: str
    model: str
    conversation_id: str | None
    with_logprobs: bool
    publish_id: str = ""
    choices: int = 1  # n
    prompt_logprobs: int | None = None  # vLLM's field's k: the answer's top-level `prompt_logprobs`

    def completion(self, texts: list[str], entries: list[list[TokenLogprob]], done: TurnDone,
                   prompt: tuple[PromptLogprob, ...] | None = None) -> dict[str, Any]:
        """The whole answer; `texts` and `entries` by choice index (the prompt's logprobs are
        every choice's: once, at the top level)."""
        choices = []
        for end, text, logprobs in zip(choice_ends(done), texts, entries):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if end.tool_calls:
                message["content"] = text or None  # OpenAI's shape: no content beside the calls is null
                message["tool_calls"] = [tool_call(call) for call in end.tool_calls]
            choices.append({"index": end.index, "message": message, "finish_reason": end.finish_reason,
                            "logprobs": logprobs_of(logprobs) if self.with_logprobs else None})
        body = self.envelope("chat.completion", choices, usage=usage_of(done), done=done, last=True)
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(prompt or (), self.prompt_logprobs)
        return body

    def sse_start(self) -> Iterator[str]:
        for index in range(self.choices):
            yield data(self.envelope("chat.completion.chunk", [{
                "index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                "logprobs": None}]))

    def sse_delta(self, delta: TurnDelta) -> str:
        body: dict[str, Any] = {"content": delta.text} if delta.text or not delta.tool_calls else {}
        if delta.tool_calls:
            body["tool_calls"] = [tool_call_delta(d) for d in delta.tool_calls]
        choice = {"index": delta.index, "delta": body, "finish_reason": None,
                  "logprobs": logprobs_of(delta.logprobs) if self.with_logprobs else None}
        return data(self.envelope("chat.completion.chunk", [choice]))

    def sse_end(self, done: TurnDone, include_usage: bool) -> Iterator[str]:
        """One finish_reason per choice, each in a chunk of its own (the last one carries the turn)."""
        ends = choice_ends(done)
        for end in ends:
            final = {"index": end.index, "delta": {}, "finish_reason": end.finish_reason, "logprobs": None}
            last = end is ends[-1]
            yield data(self.envelope("chat.completion.chunk", [final], done=done if last else None,
                                     last=last and not include_usage))
        if include_usage:
            yield data(self.envelope("chat.completion.chunk", [], usage=usage_of(done), done=done, last=True))
        yield SSE_DONE

    @staticmethod
    def sse_error(error: APIError) -> str:
        return data(error.body())

    def envelope(self, kind: str, choices: list, *, usage: dict | None = None,
                 done: TurnDone | None = None, last: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.request_id, "object": kind, "created": int(time.time()),
                                "model": self.model, "choices": choices}
        if kind == "chat.completion" or usage is not None:
            body["usage"] = usage
        if self.conversation_id is not None:
            body["conversation_id"] = self.conversation_id
            if done is not None:
                body["turn"] = done.turn
                body["response_id"] = str(ResponseId(self.conversation_id, done.turn,
                                                     self.publish_id or self.request_id))
        if last and done is not None:
            body["hybridserve"] = served_by(done)
        return body
