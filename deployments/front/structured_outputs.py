"""vLLM's structured-output fields, on chat completions and completions alike.

    structured_outputs   {"json": schema | "regex": str | "choice": [str] | "grammar": str |
                          "json_object": true, "whitespace_pattern", "disable_any_whitespace",
                          "disable_additional_properties"}   (vLLM's StructuredOutputsParams)
    guided_json, guided_regex, guided_choice, guided_grammar       vLLM's older top-level forms
    guided_whitespace_pattern, guided_decoding_backend             of the same

Each becomes a constraint of our grammar engine (workers/grammar, on llguidance, as vLLM's
"guidance" backend): json -> json_schema, regex -> regex, choice -> an alternation of the literal
strings, grammar -> a Lark grammar (or GBNF, turned into Lark, as vLLM's guidance backend does).

One kind per request: two of them (in either form), or one beside a JSON response_format or a
forced tool_choice, is a 400 naming the fields (vLLM refuses two kinds too). With tool_choice
"auto" the structured output wins, as a response_format does.

What maps how:
    whitespace_pattern        the whitespace allowed between JSON tokens (JSON kinds only; a 400
                              with another kind). Without it JSON has none beyond ", " and ": "
                              (a model could loop in free whitespace): disable_any_whitespace is
                              therefore always in effect, true or false.
    disable_additional_properties   objects of the schema with properties and no
                              additionalProperties get additionalProperties: false (as vLLM does)
    guided_decoding_backend   "auto" or "guidance" (with vLLM's options "disable-any-whitespace",
                              "no-additional-properties"); any other backend is a 400: this server
                              has only llguidance
    structural_tag            not served: a 400 unless null
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, StrictBool, field_validator, model_validator
from pydantic_core import PydanticCustomError

from deployments.front.request_base import RequestModel, field_error

INT64 = 1 << 63
BACKENDS = ("auto", "guidance")
BACKEND_OPTIONS = ("disable-any-whitespace", "no-additional-properties")
MAX_CHOICES = 1024
Choices = Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]
# Not schemas: their values are data, never walked for additionalProperties.
_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def _schema(field: str, value: dict[str, Any] | str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise field_error(field, f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise field_error(field, "must be a JSON schema object")
    return value


def _closed(schema: Any) -> Any:
    """`schema` with additionalProperties: false on every object with properties that sets none."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: value if key in _DATA_KEYWORDS else _closed(value) for key, value in schema.items()}
    if "additionalProperties" not in closed and isinstance(closed.get("properties"), dict):
        closed["additionalProperties"] = False
    return closed


class StructuredOutputs(RequestModel):
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: Choices | None = None
    grammar: str | None = Field(None, min_length=1)
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: str | None = Field(None, min_length=1)
    structural_tag: Any = Field(None, description="not served: refused unless null")

    @field_validator("structural_tag", mode="before")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError("unsupported", "{field} is not supported by this server",
                                      {"field": "structured_outputs.structural_tag"})
        return value


class StructuredOutputFields(RequestModel):
    """The fields, as a base of the request models."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: Choices | None = None
    guided_grammar: str | None = Field(None, min_length=1)
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = Field(None, min_length=1)

    @field_validator("guided_decoding_backend")
    @classmethod
    def _our_backend(cls, value: str | None) -> str | None:
        if value is None:
            return value
        name, _, options = value.partition(":")
        unknown = [o for o in options.split(",") if o and o not in BACKEND_OPTIONS]
        if name not in BACKENDS or unknown:
            raise field_error("guided_decoding_backend", f"{value!r} cannot be honoured: structured outputs here run on "
                         f"llguidance ({' or '.join(map(repr, BACKENDS))}, options {', '.join(BACKEND_OPTIONS)})")
        return value

    def structured_kinds(self) -> list[str]:
        """The fields that ask for a kind of structured output (one at most may be given)."""
        so = self.structured_outputs
        named = [f"guided_{k}" for k in ("json", "regex", "choice", "grammar")
                 if getattr(self, f"guided_{k}") is not None]
        if so is not None:
            named += [f"structured_outputs.{k}" for k in ("json", "regex", "choice", "grammar", "json_object")
                      if getattr(so, "json_" if k == "json" else k) is not None]
        return named

    @model_validator(mode="after")
    def _one_kind(self) -> "StructuredOutputFields":
        kinds = self.structured_kinds()
        if len(kinds) > 1:
            raise field_error(kinds[1], f"only one kind of structured output per request: {' and '.join(kinds)} given")
        if self.structured_outputs is not None and not kinds:
            raise field_error("structured_outputs", "needs one of json, regex, choice, grammar, json_object")
        if self._whitespace_pattern() is not None and kinds and kinds[0].split(".")[-1] not in (
                "guided_json", "json", "json_object"):
            raise field_error(self._whitespace_field(), f"whitespace_pattern applies to JSON output, not {kinds[0]}")
        return self

    def check_beside(self, others: dict[str, bool]) -> None:
        """Refuse a structured output beside another constraint of the request (`others`: field
        name -> whether that field asks for a grammar)."""
        kinds = self.structured_kinds()
        given = [name for name, asks in others.items() if asks]
        if kinds and given:
            raise field_error(kinds[0], f"{kinds[0]} cannot be combined with {given[0]}")

    def _whitespace_field(self) -> str:
        so = self.structured_outputs
        return "guided_whitespace_pattern" if so is None or so.whitespace_pattern is None else \
            "structured_outputs.whitespace_pattern"

    def _whitespace_pattern(self) -> str | None:
        so = self.structured_outputs
        return self.guided_whitespace_pattern if so is None or so.whitespace_pattern is None else so.whitespace_pattern

    def structured_constraint(self) -> dict[str, Any] | None:
        """The constraint (workers/grammar/constraint.py's wire dict) the fields ask for, or None."""
        kinds = self.structured_kinds()
        if not kinds:
            return None
        so = self.structured_outputs
        field = kinds[0]
        name = field.removeprefix("guided_").removeprefix("structured_outputs.")
        if field.startswith("guided_"):
            value = getattr(self, field)
        else:
            value = getattr(so, "json_" if name == "json" else name)
        whitespace = self._whitespace_pattern() or ""
        if name == "json_object":
            return {"type": "json_object", "whitespace_pattern": whitespace}
        if name == "json":
            schema = _schema(field, value)
            backend_options = (self.guided_decoding_backend or "").partition(":")[2].split(",")
            if (so is not None and so.disable_additional_properties) or "no-additional-properties" in backend_options:
                schema = _closed(schema)
            return {"type": "json_schema", "schema": schema, "strict": True, "whitespace_pattern": whitespace}
        if name == "choice":
            return {"type": "choice", "choices": list(value)}
        return {"type": name, name: value}

    @model_validator(mode="after")
    def _schema_is_json(self) -> "StructuredOutputFields":
        self.structured_constraint()  # a schema given as text that is not JSON: a 400 now
        return self
