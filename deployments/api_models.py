"""The HTTP schema: OpenAI's chat completions request plus `conversation_id`, `cache_salt`,
`deterministic` and `wait_if_busy`. Pydantic validates; anything out of range is a 400.

Every bound the cache service puts on what a turn publishes is checked here, before the turn
runs (a turn refused at its publish would fail after its whole reply streamed):

    conversation_id   <= max_id_bytes UTF-8 bytes
    cache_salt        <= max_id_bytes - SCOPE_PREFIX_BYTES (the API key's scope is prefixed to it)
    messages          <= max_messages_per_turn - 1 (the reply is the turn's last message)
    message content   bounded by max_body_bytes, which settings.py keeps under max_turn_content_bytes

Fields of OpenAI's request that this server does not implement are refused with a 400 naming
the field (`code: unsupported_parameter`) unless their value means "off" (`tools: []`,
`presence_penalty: 0`, ...); fields nobody reads (`user`, `metadata`, `service_tier`, ...)
are accepted and ignored; anything else unknown is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic_core import PydanticCustomError

from cache_service.client import SERVICE_LIMITS
from deployments.settings import MAX_OUTPUT_TOKENS, SCOPE_PREFIX_BYTES

MAX_ID = 256  # characters of the fields the cache service never sees (model, name, user)
MAX_ID_BYTES = SERVICE_LIMITS.max_id_bytes
MAX_SALT_BYTES = MAX_ID_BYTES - SCOPE_PREFIX_BYTES
MAX_MESSAGES = SERVICE_LIMITS.max_messages_per_turn - 1
MAX_STOP = 4
MAX_STOP_CHARS = 256


def _unicode(value: str) -> str:
    # JSON may carry lone surrogates ("\ud800"): valid for json.loads, not text a tokenizer takes.
    try:
        value.encode()
    except UnicodeEncodeError:
        raise PydanticCustomError("invalid_text", "must be valid Unicode text (no lone surrogates)") from None
    return value


def _bytes_at_most(limit: int):
    def check(value: str) -> str:
        if len(value.encode()) > limit:
            raise PydanticCustomError("too_long", "must be at most {limit} bytes in UTF-8", {"limit": limit})
        return value
    return check


Text = Annotated[str, AfterValidator(_unicode)]
ConversationId = Annotated[str, StringConstraints(min_length=1), AfterValidator(_unicode),
                           AfterValidator(_bytes_at_most(MAX_ID_BYTES))]
CacheSalt = Annotated[str, AfterValidator(_unicode), AfterValidator(_bytes_at_most(MAX_SALT_BYTES))]
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]


def _off(value: Any) -> bool:
    return value in (None, False, 0, "", [], {}, "none", "text", {"type": "text"}, ["text"])


def _unsupported(field: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", "{field} is not supported by this server", {"field": field})


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None  # bounded by the body size limit (413)
    name: Text | None = Field(None, max_length=MAX_ID)
    tool_call_id: Text | None = Field(None, max_length=MAX_ID, description="accepted, ignored")
    # What an assistant message of a reply carries, sent back as history: accepted when empty.
    refusal: None = None
    annotations: list[Any] | None = None
    tool_calls: Any = Field(None, description="not supported: refused unless null or empty")
    function_call: Any = Field(None, description="not supported: refused unless null")
    audio: Any = Field(None, description="not supported: refused unless null")

    @field_validator("annotations", "tool_calls", "function_call", "audio", mode="before")
    @classmethod
    def _refuse(cls, value: Any, info) -> Any:
        if not _off(value):
            raise _unsupported(info.field_name)
        return value

    def as_engine_message(self) -> dict[str, str]:
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        return {"role": self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = Field(False, description="accepted, ignored (no obfuscation padding is sent)")


# OpenAI request fields this server does not implement: refused unless their value means "off".
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
               "presence_penalty", "frequency_penalty", "audio", "modalities", "prediction", "reasoning_effort",
               "verbosity", "web_search_options", "store")


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text = Field(max_length=MAX_ID)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Accepted and ignored: nothing here depends on them.
    user: Text | None = Field(None, max_length=MAX_ID)
    safety_identifier: Text | None = Field(None, max_length=MAX_ID)
    prompt_cache_key: Text | None = Field(None, max_length=MAX_ID, description="ignored: see cache_salt")
    metadata: dict[str, Text] | None = Field(None, max_length=16)
    service_tier: Text | None = Field(None, max_length=MAX_ID)
    parallel_tool_calls: bool | None = Field(None, description="ignored: tools are not supported")
    # Not implemented: a 400 unless off (null, false, 0, empty, "none", "text", ["text"]).
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    # hybridserve extensions
    conversation_id: ConversationId | None = Field(
        None, description="continue this conversation; send only the new messages")
    cache_salt: CacheSalt = Field("", description="isolates cached state; another salt never shares it")
    deterministic: bool = Field(False, description="bit-identical output whatever else is batched")
    wait_if_busy: bool = Field(False, description="wait for a turn in flight instead of a 409")

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _refuse(cls, value: Any, info) -> Any:
        if not _off(value):
            raise _unsupported(info.field_name)
        return value

    def sampling(self, default_max_tokens: int) -> dict:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "max_tokens": self.max_completion_tokens or self.max_tokens or default_max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": tuple(s for s in stop if s),
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "deterministic": self.deterministic,
        }
