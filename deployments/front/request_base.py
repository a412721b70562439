"""The base of every request body model: unknown fields refused, and an explicit `null` taken as
"not given".

The official SDKs send `null` for every argument application code passes as `None`
(`temperature=None`, `stream_options=None`, ...): such a request must get the same reply as one
that leaves those fields out, so a null is dropped before validation and the field's default
applies (a required field then is missing: 400, as when it is left out).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


def field_error(field: str, message: str) -> PydanticCustomError:
    """A 400 naming `field` (the ingress's handler turns it into OpenAI's error body)."""
    return PydanticCustomError("invalid_field", "{message}", {"field": field, "message": message})
