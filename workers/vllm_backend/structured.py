"""A constraint (workers/grammar/constraint.py) as vLLM's structured outputs, run by its guidance
backend: llguidance, as on our engine, with the same grammars.

    json_object / json_schema  {"json": schema}, with our JSON style (x-guidance: json.dumps'
                               separators, no free whitespace) unless the schema sets its own
    regex / choice / grammar   {"regex" | "choice" | "grammar": the request's own}
    tool_calls                 {"grammar": the tool format's Lark grammar}: a forced call (tool_choice
                               "required" or named), or "auto"'s lazy one (text, but a begun call valid)

vLLM's guidance backend makes json and the others with the same llguidance calls as our
compiler; schemas are checked by our compiler first (VllmSession.prepare_grammar), so a bad one
is a 400 before the host sees it.
"""

from __future__ import annotations

from typing import Any

from workers.grammar.constraint import Constraint, ConstraintKind
from workers.tools.formats import JSON_STYLE, ToolFormat


def _styled(schema: dict[str, Any], whitespace_pattern: str) -> dict[str, Any]:
    if "x-guidance" in schema:  # the client's own options win, as our compiler's defaults give way to them
        return schema
    style = dict(JSON_STYLE, whitespace_pattern=whitespace_pattern) if whitespace_pattern else JSON_STYLE
    return {**schema, "x-guidance": style}


def structured_outputs(constraint: Constraint, tool_format: ToolFormat) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams arguments for `constraint`."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return {"json": _styled({"type": "object"}, constraint.whitespace_pattern)}
    if kind is ConstraintKind.JSON_SCHEMA:
        return {"json": _styled(constraint.value(), constraint.whitespace_pattern)}
    if kind is ConstraintKind.TOOL_CALLS:
        build = tool_format.auto_grammar if constraint.auto else tool_format.grammar
        return {"grammar": build(constraint.value(), constraint.parallel)}
    return {kind.value: constraint.value()}
