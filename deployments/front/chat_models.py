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
`store: false`, ...); fields nobody reads (`user`, `metadata`, `service_tier`, ...)
are accepted and ignored; anything else unknown is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, Field, StrictBool, StrictFloat, StrictInt, StringConstraints, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from cache_service.client import SERVICE_LIMITS
from deployments.front import vllm_fields
from deployments.front.request_base import RequestModel, field_error
from deployments.front.sampling_fields import (MAX_CHOICES, check_choices, check_min_tokens, processor_sampling,
                                              special_tokens_sampling, template_options, vllm_sampling)
from deployments.front.structured_outputs import StructuredOutputFields
from deployments.front.vllm_sampling import VllmTextFields
from deployments.settings import SCOPE_PREFIX_BYTES
from workers.template_options import TemplateOptions

MAX_ID = 256  # characters of the fields the cache service never sees (model, name, user)
MAX_ID_BYTES = SERVICE_LIMITS.max_id_bytes
MAX_SALT_BYTES = MAX_ID_BYTES - SCOPE_PREFIX_BYTES
MAX_MESSAGES = SERVICE_LIMITS.max_messages_per_turn - 1
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (each a token of the vocabulary)


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
# OpenAI's and vLLM's sampling processors (workers/logits_processors.py); JSON keys are strings.
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
LogitBias = Annotated[dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")],
                           Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)]


def _off(value: Any) -> bool:
    return value in (None, False, 0, "", [], {}, "none", "text", {"type": "text"}, ["text"])


def _unsupported(field: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", "{field} is not supported by this server", {"field": field})


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = Field(None, description="Anthropic-style prompt caching hint that agent "
                                                 "frameworks resend: accepted, dropped (caching here is automatic)")


ToolName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
MAX_TOOLS = 128


class FunctionCall(RequestModel):
    name: ToolName
    arguments: Text  # JSON text, as the model wrote it


class MessageToolCall(RequestModel):
    """A tool call of an assistant message sent back as history."""

    id: Text = Field(max_length=MAX_ID)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = Field(None, description="a streamed call's index, resent by agent frameworks: dropped")

    def as_engine(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None  # bounded by the body size limit (413)
    name: Text | None = Field(None, max_length=MAX_ID)
    tool_call_id: Text | None = Field(None, max_length=MAX_ID)
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOLS)
    # What an assistant message of a reply carries, sent back as history: accepted when empty.
    refusal: None = None
    annotations: list[Any] | None = None
    function_call: Any = Field(None, description="not supported (deprecated by OpenAI): refused unless null")
    audio: Any = Field(None, description="not supported: refused unless null")

    @field_validator("annotations", "function_call", "audio", mode="before")
    @classmethod
    def _refuse(cls, value: Any, info) -> Any:
        if not _off(value):
            raise _unsupported(info.field_name)
        return value

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "only assistant messages carry tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise PydanticCustomError("tool_call_id_role", "only tool messages carry tool_call_id")
        return self

    def as_engine_message(self) -> dict[str, Any]:
        if isinstance(self.content, list):  # parts are lines of one text (as vLLM joins them)
            text = "\n".join(part.text for part in self.content)
        else:
            text = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [call.as_engine() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:  # a template may render it (a conversation's ledger keeps role and content)
            message["name"] = self.name
        return message


class FunctionDefinition(RequestModel):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (checked when it is compiled)
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("type", "object") != "object":
            raise PydanticCustomError("parameters_object", "a function's parameters must be a JSON schema of an object")
        return value


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition

    def as_engine(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(RequestModel):
    name: ToolName


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("json_schema", "json_schema is required with type json_schema, and only then")
        return self


def check_tool_choice(names: list[str], choice: Any, named: str | None, formatted: bool, format_field: str) -> None:
    """The tools and tool_choice of a request fit each other and its response format (`named`:
    the function a named choice names; `formatted`: a JSON response format is asked for)."""
    if len(set(names)) != len(names):
        raise field_error("tools", "tool names must be unique")
    if choice not in (None, "none") and not names:
        raise field_error("tool_choice", "tool_choice needs tools")
    if named is not None and named not in names:
        raise field_error("tool_choice", f"tool_choice names {named!r}, which is not among the tools")
    if (choice == "required" or named is not None) and formatted:
        raise field_error(format_field, f"{format_field} cannot be combined with a forced tool_choice")


def reply_constraint(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool, format_type: str,
                     schema: dict[str, Any] | None = None, strict: bool = False) -> dict[str, Any] | None:
    """The grammar of a reply (chat completions and responses alike): forced tool calls, else a
    JSON response format, else tool calls the model may begin ("auto"), else None. With
    tool_choice "auto" the response format wins: the reply is that JSON."""
    tools_grammar = tool_constraint(tools, tool_choice, parallel)
    if tools_grammar is not None and not tools_grammar["auto"]:
        return tools_grammar  # (a forced choice beside a response format is refused before this)
    if format_type == "json_object":
        return {"type": "json_object"}
    if format_type == "json_schema":
        return {"type": "json_schema", "schema": schema or {}, "strict": strict}
    return tools_grammar


def tool_constraint(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> dict[str, Any] | None:
    """The grammar of a reply with tools (engine-shaped: {"type": "function", "function": {...}}):
    "required" or a named function force calls; "auto" (the default with tools) lets the model
    write text, but a call it begins must be valid; None for "none" or no tools."""
    if not tools or tool_choice == "none":
        return None
    auto = tool_choice in (None, "auto")
    if isinstance(tool_choice, dict):
        chosen = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    else:
        chosen = tools
    return {"type": "tool_calls", "parallel": parallel, "auto": auto,
            "tools": [{"name": t["function"]["name"], "parameters": t["function"].get("parameters") or {}}
                      for t in chosen]}


class StreamOptions(RequestModel):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool = Field(False, description="accepted, ignored (no obfuscation padding is sent)")


# OpenAI request fields this server does not implement: refused unless their value means "off".
UNSUPPORTED = ("functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
               "verbosity", "web_search_options", "store")


class ChatCompletionRequest(StructuredOutputFields, VllmTextFields):
    model: Text = Field(max_length=MAX_ID)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    # Any length: clamped to the server's max_output_tokens and to what the context leaves.
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=1 << 63)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES, description="replies, forked from one prefill (choice 0 is the one "
                                                                "a conversation commits)")
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)  # vLLM's: the prompt's, top level (not streamed)
    # Accepted and ignored: nothing here depends on them.
    user: Text | None = Field(None, max_length=MAX_ID)
    safety_identifier: Text | None = Field(None, max_length=MAX_ID)
    prompt_cache_key: Text | None = Field(None, max_length=MAX_ID, description="ignored: see cache_salt")
    metadata: dict[str, Text] | None = Field(None, max_length=16)
    service_tier: Text | None = Field(None, max_length=MAX_ID)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: Penalty = Field(0.0, description="minus this for each token the reply already has")
    frequency_penalty: Penalty = Field(0.0, description="minus this times each token's count in the reply")
    logit_bias: LogitBias | None = Field(None, description="token id (a string) -> bias in [-100, 100]")
    # Not implemented: a 400 unless off (null, false, 0, empty, "none", "text", ["text"]).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    # vLLM's extensions, as its OpenAI server means them (its sampling ones: VllmTextFields)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables of the chat template")
    add_generation_prompt: StrictBool = Field(True, description="end the prompt with the assistant's opening")
    continue_final_message: StrictBool = Field(False, description="leave the last (assistant) message open: the "
                                                                  "reply continues it")
    request_id: Text | None = Field(None, min_length=1, max_length=MAX_ID,
                                    description="names the reply: its id is chatcmpl-<request_id>")
    # hybridserve extensions
    conversation_id: ConversationId | None = Field(
        None, description="continue this conversation; send only the new messages")
    cache_salt: CacheSalt = Field("", description="isolates cached state; another salt never shares it")
    deterministic: StrictBool = Field(False, description="bit-identical output whatever else is batched")
    wait_if_busy: StrictBool = Field(False, description="wait for a turn in flight instead of a 409")

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _refuse(cls, value: Any, info) -> Any:
        if not _off(value):
            raise _unsupported(info.field_name)
        return value

    @model_validator(mode="before")
    @classmethod
    def _vllm_and_unknown_fields(cls, data: Any) -> Any:
        return vllm_fields.screen(cls, data)

    @model_validator(mode="after")
    def _tools_fit(self) -> "ChatCompletionRequest":
        check_min_tokens(self.min_tokens, self.max_completion_tokens or self.max_tokens)
        check_choices(self.n, self.deterministic)
        self.template_options()  # refuses what cannot render
        if self.prompt_logprobs is not None and (self.stream or self.conversation_id is not None):
            raise field_error("prompt_logprobs", "prompt_logprobs is not available when streaming or on a conversation")
        choice = self.tool_choice
        formatted = self.response_format is not None and self.response_format.type != "text"
        check_tool_choice([t.function.name for t in self.tools or ()], choice,
                          choice.function.name if isinstance(choice, NamedToolChoice) else None,
                          formatted, "response_format")
        forced = bool(self.tools) and (choice == "required" or isinstance(choice, NamedToolChoice))
        self.check_beside({"response_format": formatted, "tool_choice": forced})
        return self

    def engine_tools(self) -> tuple[dict[str, Any], ...]:
        return tuple(t.as_engine() for t in self.tools or ())

    def template_options(self) -> TemplateOptions:
        """How the chat template renders the messages (vLLM's fields; 400s as its server's)."""
        return template_options(self.chat_template_kwargs, self.add_generation_prompt, self.continue_final_message,
                                self.messages[-1].role, self.conversation_id is not None)

    @property
    def calls_tools(self) -> bool:
        """Whether the reply's text is parsed for tool calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def constraint(self) -> dict[str, Any] | None:
        """The grammar the reply must follow (the worker compiles it), or None."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        fmt = self.response_format
        schema = fmt.json_schema if fmt is not None and fmt.type == "json_schema" else None
        tools = list(self.engine_tools())
        parallel = self.parallel_tool_calls is not False
        structured = self.structured_constraint()  # alone, or beside tool_choice "auto": it wins
        if structured is not None:
            return structured
        return reply_constraint(tools, choice, parallel, fmt.type if fmt is not None else "text",
                                schema.schema_ if schema else None, bool(schema and schema.strict))

    def sampling(self, max_output_tokens: int) -> dict:
        """The SamplingParams fields (`max_output_tokens`: the server's cap, the default of
        max_tokens; the worker clamps it further to what the context leaves)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "max_tokens": min(self.max_completion_tokens or self.max_tokens or max_output_tokens, max_output_tokens),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": tuple(s for s in stop if s),
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "prompt_logprobs": self.prompt_logprobs,
            "deterministic": self.deterministic,
            "n": self.n,
            "constraint": self.constraint(),
            "priority": self.priority,
            **vllm_sampling(self.top_k, self.min_p, self.stop_token_ids, self.ignore_eos,
                            self.include_stop_str_in_output),
            **processor_sampling(self),
            **special_tokens_sampling(self),
        }
