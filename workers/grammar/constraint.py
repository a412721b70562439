"""What a request's reply must be: the grammar a `SamplingParams.constraint` names.

    {"type": "json_object"}                                any JSON object
    {"type": "json_schema", "schema": {...}, "strict": b}  a JSON value valid for the schema
    {"type": "tool_calls", "tools": [{"name", "parameters"}], "parallel": b}
                                                           one call (or several) of those tools,
                                                           in the template's tool-call form
    {"type": "tool_calls", ..., "auto": true}              any text, but a call the model begins
                                                           must be a valid call (tool_choice auto)

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


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    schema: str = ""  # JSON_SCHEMA: the schema; TOOL_CALLS: the list of tools; canonical JSON
    parallel: bool = True  # TOOL_CALLS: more than one call allowed
    auto: bool = False  # TOOL_CALLS: calls are optional (text otherwise)

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
        if kind is ConstraintKind.JSON_OBJECT:
            return cls(kind)
        if kind is ConstraintKind.JSON_SCHEMA:
            schema = value.get("schema")
            if not isinstance(schema, dict):
                raise InvalidRequestError("a json_schema constraint needs a schema object")
            return cls(kind, _canonical(schema))
        tools = value.get("tools")
        if not isinstance(tools, list) or not tools or not all(
                isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
            raise InvalidRequestError("a tool_calls constraint needs a list of named tools")
        return cls(kind, _canonical([{"name": t["name"], "parameters": t.get("parameters") or {}} for t in tools]),
                   bool(value.get("parallel", True)), bool(value.get("auto", False)))

    def value(self) -> Any:
        return json.loads(self.schema) if self.schema else None
