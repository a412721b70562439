"""How a chat template writes tool calls into a reply's text, and how they are read back.

A template renders the request's tools into the prompt and an assistant message's tool calls
into text; the model answers in the same text form. A `ToolFormat` names that form once:

    calls_text(calls)   the text a template renders for calls (and what a forced call emits)
    grammar(tools, ..)  an llguidance Lark grammar that only lets the model write valid calls
    parser()            a streaming parser: text deltas in, content and tool-call pieces out

Two forms are known, chosen by the template's own text (`tool_format_for`):

    hermes    <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (built-in, Granite 4.0-H;
              whitespace around the JSON is accepted when parsing)
    nemotron  <TOOLCALL>[{"name": "f", "arguments": {...}}, ...]</TOOLCALL>   (Nemotron-H)

The JSON is written with `", "` and `": "` separators (json.dumps' default): a forced call's
text is then exactly what the template renders when the client sends the call back, so the
next request's prompt shares the reply's tokens. Pure Python: the ingress imports it too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# llguidance's JSON options (x-guidance): json.dumps' separators, no free whitespace (a random
# or weak model would otherwise fill the budget with it).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_PARALLEL_CALLS = 8  # a forced reply holds at most this many calls


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as written


@dataclass
class ParsedPiece:
    """What a chunk of reply text adds: content, and pieces of calls (index, name, arguments);
    a call's first piece has its name, the later ones only more of its arguments."""

    content: str = ""
    calls: list[tuple[int, str, str]] = field(default_factory=list)


def call_json(name: str, arguments: str) -> str:
    """One call as the formats write it: the arguments' text kept verbatim (as the model wrote
    them, or as the client sent them back)."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ' + arguments + "}"


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's parameters as the schema of its arguments: always a JSON object."""
    if not parameters:
        return {"type": "object"}
    if "type" not in parameters and "properties" in parameters:
        return {"type": "object", **parameters}
    return parameters


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                             "arguments": arguments_schema(tool.get("parameters"))},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_STYLE}


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _call_alternatives(tools: Sequence[dict[str, Any]]) -> list[str]:
    """Lark rules, one per tool, each a JSON call object of that tool."""
    return [f"call_{i}: %json {json.dumps(_call_schema(tool))}" for i, tool in enumerate(tools)]


class ToolFormat:
    name = ""
    start_tag = ""
    end_tag = ""

    def calls_text(self, calls: Iterable[ParsedCall]) -> str:
        raise NotImplementedError

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        """Lark source: a reply that is one call (or 1..MAX_PARALLEL_CALLS with `parallel`) of
        the given tools ({"name", "parameters"}), nothing else."""
        raise NotImplementedError

    def parse_block(self, inner: str) -> list[ParsedCall] | None:
        """The calls of the text between a start and an end tag; None if it is not valid."""
        raise NotImplementedError

    def block_rule(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        """Lark: what follows the start tag up to and including the end tag."""
        raise NotImplementedError

    def auto_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        """Lark source for tool_choice "auto": any text, but once the model writes the start
        tag (a lazy trigger) what follows must be valid calls of the tools and the end tag."""
        count = "*" if parallel else "?"
        return "\n".join([
            "%llguidance {}",
            f"start: call{count} text",
            "text: TEXT",
            "TEXT: /(.|\n)*/",
            f"call_start[lazy]: TEXT {_lark_string(self.start_tag)}",
            f"call: call_start {self.block_rule(tools, parallel)}",
            *_call_alternatives(tools),
        ])

    def parser(self) -> "ToolCallParser":
        return ToolCallParser(self)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The whole reply: (content, calls), exactly what streaming it gives."""
        parser = self.parser()
        parser.feed(text)
        parser.finish()
        return parser.content, parser.calls


class HermesFormat(ToolFormat):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    # The head of a call object up to its arguments: what a stream can name a call by.
    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

    def calls_text(self, calls: Iterable[ParsedCall]) -> str:
        return "".join(f"{self.start_tag}{call_json(c.name, c.arguments)}{self.end_tag}" for c in calls)

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        count = f"{{1,{MAX_PARALLEL_CALLS}}}" if parallel else ""
        return "\n".join([
            f"start: call{count}",
            f"call: {_lark_string(self.start_tag)} {self.block_rule(tools, parallel)}",
            *_call_alternatives(tools),
        ])

    def block_rule(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        return f"({alternatives}) {_lark_string(self.end_tag)}"

    def parse_block(self, inner: str) -> list[ParsedCall] | None:
        call = _one_call(inner)
        return None if call is None else [call]


class NemotronFormat(ToolFormat):
    name = "nemotron"
    start_tag = "<TOOLCALL>"
    end_tag = "</TOOLCALL>"

    def calls_text(self, calls: Iterable[ParsedCall]) -> str:
        calls = list(calls)
        if not calls:
            return ""
        return f"{self.start_tag}[{', '.join(call_json(c.name, c.arguments) for c in calls)}]{self.end_tag}"

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        return "\n".join([
            f"start: {_lark_string(self.start_tag)} {self.block_rule(tools, parallel)}",
            *_call_alternatives(tools),
        ])

    def block_rule(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        more = f' (", " ({alternatives})){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return f'"[" ({alternatives}){more} "]" {_lark_string(self.end_tag)}'

    def parse_block(self, inner: str) -> list[ParsedCall] | None:
        try:
            items = json.loads(inner)
        except ValueError:
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = []
        for item in items:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"]
                    and isinstance(item.get("arguments"), dict)):
                return None
            calls.append(ParsedCall(item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
        return calls


def _one_call(inner: str) -> ParsedCall | None:
    """`{"name": ..., "arguments": {...}}`, the arguments' text kept as written."""
    head = HermesFormat.HEAD.match(inner)
    if head is not None:
        body = inner[head.end():].rstrip()
        if body.endswith("}"):
            arguments = body[:-1].rstrip()
            try:
                name, args = json.loads(head.group(1)), json.loads(arguments)
            except ValueError:
                args = None
            if isinstance(args, dict) and name:
                return ParsedCall(name, arguments)
    try:  # another key order or spacing: the arguments are written anew
        value = json.loads(inner)
    except ValueError:
        return None
    if isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"] \
            and isinstance(value.get("arguments"), dict):
        return ParsedCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False))
    return None


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag` (kept until the next delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Splits a streamed reply into content and tool calls.

    Content is the text before the first call, plus any text other than whitespace between or
    after calls. In the hermes form a call streams as it is written: its name once the JSON
    reaches its arguments, then the arguments' text, all but a tail that may still turn out to
    be the call's closing brace. In other forms each block's calls come whole at its end tag.
    The reply's calls are those whose block ended and parsed; the text of a block that did not
    (cut by max_tokens, or not JSON) is neither content nor a call (`broken` says so). Under a
    grammar (tool_choice auto, required, named) every call that ends is valid."""

    def __init__(self, form: ToolFormat):
        self.form = form
        self.text = ""
        self.content = ""
        self._pos = 0  # text before this is handled
        self._in_block = False
        self._calls: list[ParsedCall] = []
        self._broken = False
        self._streamed_name = False  # the current hermes call has sent its name
        self._args_at = 0  # where the current hermes call's arguments begin
        self._args_sent = 0
        self.calls: list[ParsedCall] = []  # set by finish()
        self.broken = False  # a block did not parse or never ended

    @property
    def calls_so_far(self) -> int:
        return len(self._calls) + (1 if self._streamed_name else 0)

    def feed(self, delta: str) -> ParsedPiece:
        self.text += delta
        piece = ParsedPiece()
        while True:
            progressed = self._block(piece) if self._in_block else self._outside(piece)
            if not progressed:
                return piece

    def _outside(self, piece: ParsedPiece) -> bool:
        rest = self.text[self._pos:]
        found = rest.find(self.form.start_tag)
        visible = rest if found < 0 else rest[:found]
        if found < 0:
            visible = visible[: len(visible) - _held_back(visible, self.form.start_tag)]
        if (self._calls or self._broken) and not visible.strip():  # between or after calls: not content
            if found < 0:
                return False  # held: content only if more than whitespace follows
        else:
            self._say(piece, visible)
        self._pos += len(visible)
        if found < 0:
            return False
        self._pos += len(self.form.start_tag)
        self._in_block, self._args_at, self._args_sent = True, 0, 0
        return True

    def _say(self, piece: ParsedPiece, text: str) -> None:
        piece.content += text
        self.content += text

    def _block(self, piece: ParsedPiece) -> bool:
        inner = self.text[self._pos:]
        end = inner.find(self.form.end_tag)
        if isinstance(self.form, HermesFormat):
            self._stream_hermes(piece, inner if end < 0 else inner[:end], closed=end >= 0)
        if end < 0:
            return False
        calls = self.form.parse_block(inner[:end])
        index = len(self._calls)
        if calls is None:
            self._broken = True
        else:
            if not isinstance(self.form, HermesFormat):
                piece.calls.extend((index + i, c.name, c.arguments) for i, c in enumerate(calls))
            self._calls.extend(calls)
        self._pos += end + len(self.form.end_tag)
        self._in_block, self._streamed_name = False, False
        return True

    def _stream_hermes(self, piece: ParsedPiece, inner: str, closed: bool) -> None:
        index = len(self._calls)
        if not self._streamed_name:
            head = HermesFormat.HEAD.match(inner)
            if head is None or head.end() == len(inner):  # named once the arguments have begun
                return
            try:
                name = json.loads(head.group(1))
            except ValueError:
                return
            piece.calls.append((index, name, ""))
            self._streamed_name, self._args_at = True, head.end()
        body = inner[self._args_at:]
        if closed:  # the call object's own closing brace (and whitespace) is not arguments
            stripped = body.rstrip()
            safe = stripped[:-1].rstrip() if stripped.endswith("}") else stripped
        else:  # a "}" that only whitespace (or the start of the end tag) follows may be the object's
            body = body[: len(body) - _held_back(body, self.form.end_tag)]
            last = body.rfind("}")
            safe = body[:last] if last >= 0 and not body[last + 1:].strip() else body
        if len(safe) > self._args_sent:
            piece.calls.append((index, "", safe[self._args_sent:]))
            self._args_sent = len(safe)

    def finish(self) -> ParsedPiece:
        """After the last delta: the content held back (text that began no call); the reply's
        calls in `calls`."""
        piece = ParsedPiece()
        tail = "" if self._in_block else self.text[self._pos:]
        if tail.strip() or not (self._calls or self._broken):
            self._say(piece, tail)
        self._pos = len(self.text)
        self.calls, self.broken = list(self._calls), self._in_block or self._broken
        return piece


def plain_message(message: dict[str, Any], form: ToolFormat) -> dict[str, Any]:
    """A message as the ledger keeps it, role and content: an assistant's tool calls become the
    text they are written as (which the chat template renders the same), a tool result loses
    its call id (which the templates do not render)."""
    calls = message.get("tool_calls") or []
    if not calls:
        return {"role": message["role"], "content": message.get("content") or ""}
    parsed = []
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments", "{}")
        parsed.append(ParsedCall(fn["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return {"role": message["role"], "content": (message.get("content") or "") + form.calls_text(parsed)}


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), NemotronFormat())}


def tool_format_for(template: str | None) -> ToolFormat:
    """The form a chat template writes tool calls in (hermes unless it says otherwise)."""
    if template and NemotronFormat.start_tag in template:
        return FORMATS["nemotron"]
    return FORMATS["hermes"]


def format_named(name: str) -> ToolFormat:
    return FORMATS.get(name) or FORMATS["hermes"]
