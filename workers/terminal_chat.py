"""`hybridserve chat`: a terminal chat with a running server, over the OpenAI client.

Each reply is printed as it streams, then one footer line with what the server reused:

    you> Hello!
    Hi there, how are you?
      [turn 2 · cached 41/52 prompt tokens (conversation head) · TTFT 38 ms · replica 3f9c2a]

A conversation (the default) sends only the new message with a `conversation_id`; `--stateless`
resends the whole history each turn (cached tokens then come from the server's prefixes).
Only the `openai` package is used: this talks to the server like any client does.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

SOURCES = {"head": "conversation head", "prefix": "prefix", "system": "system prompt"}
QUIT = {"/quit", "/exit"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--api-key", default="unused", help="bearer key, if the server has api_keys")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--stateless", action="store_true",
                        help="resend the whole history each turn instead of continuing a conversation")
    parser.add_argument("--system", default=None, help="a system prompt opening the chat")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--deterministic", action="store_true", help="bit-identical replies (the server's mode)")


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    turn: int | None = None
    served: dict[str, Any] = field(default_factory=dict)  # the server's `hybridserve` extension

    def footer(self, turn_number: int) -> str:
        source = SOURCES.get(self.served.get("cached_from") or "", "")
        ttft = "—" if self.ttft_s is None else f"{self.ttft_s * 1000:.0f} ms"
        parts = [f"turn {self.turn or turn_number}",
                 f"cached {self.cached_tokens}/{self.prompt_tokens} prompt tokens" + (f" ({source})" if source else ""),
                 f"TTFT {ttft}"]
        if self.served.get("replica"):
            parts.append(f"replica {self.served['replica'][-6:]}")
        return "  [" + " · ".join(parts) + "]"


class Chat:
    """One chat's state: the conversation it continues, or the history it resends."""

    def __init__(self, client: Any, model: str, args: argparse.Namespace):
        self.client, self.model, self.args = client, model, args
        self.conversation_id = None if args.stateless else f"chat-{uuid.uuid4().hex[:16]}"
        self.cache_salt = f"terminal-{uuid.uuid4().hex[:16]}"
        self.history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
        self.turns = 0

    def _messages(self, text: str) -> list[dict[str, str]]:
        message = {"role": "user", "content": text}
        if self.conversation_id is None:
            return [*self.history, message]
        return [*self.history, message] if self.turns == 0 else [message]  # the server keeps the rest

    def send(self, text: str, on_text: Callable[[str], None]) -> TurnStats:
        body: dict[str, Any] = {"cache_salt": self.cache_salt}
        if self.conversation_id is not None:
            body["conversation_id"] = self.conversation_id
        if self.args.deterministic:
            body["deterministic"] = True
        stats, reply = TurnStats(), []
        started = time.monotonic()
        stream = self.client.chat.completions.create(
            model=self.model, messages=self._messages(text), max_tokens=self.args.max_tokens,
            temperature=self.args.temperature, stream=True, stream_options={"include_usage": True}, extra_body=body)
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    if stats.ttft_s is None:
                        stats.ttft_s = time.monotonic() - started
                    reply.append(choice.delta.content)
                    on_text(choice.delta.content)
            extra = chunk.model_extra or {}
            stats.turn = extra.get("turn", stats.turn)
            stats.served = extra.get("hybridserve") or stats.served
            if chunk.usage is not None:
                stats.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                stats.cached_tokens = (details.cached_tokens or 0) if details else 0
        self.turns += 1
        if self.conversation_id is None:
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": "".join(reply)}]
        else:
            self.history = []  # the system prompt went with the first turn
        return stats


def run(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    import openai  # only here: the engine's commands do not need it

    client = openai.OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0)
    try:
        model = args.model or client.models.list().data[0].id
    except openai.APIError as e:
        print(f"error: {error_message(e)}", file=sys.stderr)
        return 2
    chat = Chat(client, model, args)
    mode = "stateless" if args.stateless else f"conversation {chat.conversation_id}"
    print(f"hybridserve chat with {model} at {args.base_url} ({mode}); /quit or Ctrl-D ends", file=stdout)

    def show(piece: str) -> None:
        stdout.write(piece)
        stdout.flush()

    for line in _lines(stdin, stdout):
        if line in QUIT:
            break
        try:
            stats = chat.send(line, show)
        except openai.APIError as e:
            print(f"\nerror: {error_message(e)}", file=stdout)
            continue
        print(f"\n{stats.footer(chat.turns)}", file=stdout)
    return 0


def error_message(error: Exception) -> str:
    """The message of the server's OpenAI error body, as it reported it (the client keeps the
    body's `error` object; its own message adds the status and the whole body)."""
    body = getattr(error, "body", None)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return str(getattr(error, "message", error))


def _lines(stdin: TextIO, stdout: TextIO):
    """The user's non-empty lines, each after a prompt, until end of input."""
    while True:
        stdout.write("you> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            stdout.write("\n")
            return
        if line.strip():
            yield line.strip()
