"""What a request's reply must be: the grammar a `SamplingParams.constraint` names.

    {"type": "json_object"}                                any JSON object
    {"type": "json_schema", "schema": {...}, "strict": b}  a JSON value valid for the schema
    {"type": "tool_calls", "tools": [{"name", "parameters"}], "parallel": b}
                                                           one call (or several) of those tools,
                                                           in the template's tool-call form
    {"type": "tool_calls", ..., "auto": true}              any text, but a call the model begins
                                                           must be a valid call (tool_choice auto)
    {"type": "regex", "regex": "..."}                      text the regular expression matches whole
    {"type": "choice", "choices": ["a", "b"]}              exactly one of those strings
    {"type": "grammar", "grammar": "..."}                  text of a Lark (or GBNF) grammar

json_object and json_schema take "whitespace_pattern": the regex of the whitespace allowed
between JSON tokens (default: none beyond ", " and ": ", which a model cannot loop in).

A frozen value (its JSON parts kept as canonical text): equal constraints compile once, and
the sampling parameters stay comparable.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from workers.errors import InvalidRequestError


class ConstraintKind(enum.Enum):
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    TOOL_CALLS = "tool_calls"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    # Canonical JSON of what the kind needs: JSON_SCHEMA the schema, TOOL_CALLS the list of tools,
    # REGEX / GRAMMAR their text (a JSON string), CHOICE the list of strings.
    schema: str = ""
    parallel: bool = True  # TOOL_CALLS: more than one call allowed
    auto: bool = False  # TOOL_CALLS: calls are optional (text otherwise)
    whitespace_pattern: str = ""  # JSON_OBJECT / JSON_SCHEMA: the whitespace allowed ("": none)

    @classmethod
    def of(cls, value: "Constraint | dict[str, Any] | None") -> "Constraint | None":
        """From the wire's dict (the ingress's `sampling["constraint"]`)."""
        if value is None or isinstance(value, Constraint):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"constraint must be an object, got {type(value).__name__}")
        try:
            kind = ConstraintKind(value.get("type"))
        except ValueError:
            raise InvalidRequestError(f"unknown constraint type {value.get('type')!r}") from None
        whitespace = value.get("whitespace_pattern") or ""
        if not isinstance(whitespace, str):
            raise InvalidRequestError("whitespace_pattern must be a string")
        if kind is ConstraintKind.JSON_OBJECT:
            return cls(kind, whitespace_pattern=whitespace)
        if kind is ConstraintKind.JSON_SCHEMA:
            schema = value.get("schema")
            if not isinstance(schema, dict):
                raise InvalidRequestError("a json_schema constraint needs a schema object")
            return cls(kind, _canonical(schema), whitespace_pattern=whitespace)
        if kind in (ConstraintKind.REGEX, ConstraintKind.GRAMMAR):
            text = value.get(kind.value)
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"a {kind.value} constraint needs its {kind.value} text")
            return cls(kind, _canonical(text))
        if kind is ConstraintKind.CHOICE:
            choices = value.get("choices")
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise InvalidRequestError("a choice constraint needs a non-empty list of strings")
            return cls(kind, _canonical(choices))
        tools = value.get("tools")
        if not isinstance(tools, list) or not tools or not all(
                isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
            raise InvalidRequestError("a tool_calls constraint needs a list of named tools")
        return cls(kind, _canonical([{"name": t["name"], "parameters": t.get("parameters") or {}} for t in tools]),
                   bool(value.get("parallel", True)), bool(value.get("auto", False)))

    def value(self) -> Any:
        return json.loads(self.schema) if self.schema else None
