"""The HTTP schema of OpenAI's Responses API (`POST /v1/responses`) as this server takes it.

    input         a string (one user message) or a list of items:
                    {"role", "content"}            content a string or input_text / output_text parts
                    {"type": "function_call", "call_id", "name", "arguments"}
                    {"type": "function_call_output", "call_id", "output"}
    tools         function tools {"type": "function", "name", "description", "parameters", "strict"}
    text.format   {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema", "strict"}
    extensions    cache_salt, deterministic; vLLM's sampling fields (vllm_sampling.py)

Items become engine messages: a function_call joins the assistant message before it (or starts
one), a function_call_output is a "tool" message. Fields this server cannot honour are refused
with a 400 naming the field unless their value means "off", as in chat_models.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictFloat, StrictInt, Tag, field_validator, model_validator

from deployments.front.chat_models import (MAX_ID, MAX_MESSAGES, MAX_TOOLS, CacheSalt, ConversationId, Text, ToolName,
                                           _off, _unsupported, check_tool_choice, reply_constraint)
from deployments.front import vllm_fields
from deployments.front.request_base import RequestModel, field_error
from deployments.front.sampling_fields import check_min_tokens
from deployments.front.vllm_sampling import VllmSamplingFields

ItemId = Annotated[str, Field(max_length=MAX_ID)]


class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None  # what an output_text sent back carries: accepted when empty
    logprobs: list[Any] | None = None

    @field_validator("annotations")
    @classmethod
    def _no_annotations(cls, value: Any) -> Any:
        if not _off(value):
            raise _unsupported("annotations")
        return value


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputText]
    id: ItemId | None = None  # an output message sent back as input carries its id and status
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: Text = Field(max_length=MAX_ID)
    name: ToolName
    arguments: Text
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: Text = Field(max_length=MAX_ID)
    output: Text | list[InputText]
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output") else "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_kind)]


def engine_messages(items: str | list) -> list[dict[str, Any]]:
    """The input as engine messages ({"role", "content"} plus tool_calls / tool_call_id)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
    return messages


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def as_engine(self) -> dict[str, Any]:
        function = self.model_dump(exclude_none=True, exclude={"type"})
        return {"type": "function", "function": function}


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: ToolName


class JsonSchemaText(RequestModel):
    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class PlainText(RequestModel):
    type: Literal["text", "json_object"]


class TextConfig(RequestModel):
    format: Annotated[JsonSchemaText | PlainText, Field(discriminator="type")] | None = None
    verbosity: Any = None

    @field_validator("verbosity")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        if not _off(value) and value != "medium":
            raise _unsupported("text.verbosity")
        return value

    def echo(self) -> dict[str, Any]:
        fmt = self.format.model_dump(by_alias=True, exclude_none=True) if self.format else {"type": "text"}
        return {"format": fmt, "verbosity": "medium"}


class ConversationParam(RequestModel):
    id: ConversationId


# Responses fields this server does not implement: refused unless their value means "off".
UNSUPPORTED = ("reasoning", "include", "background", "top_logprobs", "max_tool_calls", "prompt",
               "prompt_cache_retention", "context_management")


class ResponsesRequest(VllmSamplingFields):
    model: Text = Field(max_length=MAX_ID)
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    previous_response_id: Text | None = Field(None, min_length=1, max_length=1024)
    conversation: ConversationId | ConversationParam | None = None
    store: StrictBool = True
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)  # clamped as chat's max_tokens
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    stream: StrictBool = False
    truncation: Literal["disabled"] | None = Field(None, description="only \"disabled\": a too long input is a 400")
    # Accepted and ignored: nothing here depends on them.
    metadata: dict[str, Text] | None = Field(None, max_length=16)
    user: Text | None = Field(None, max_length=MAX_ID)
    safety_identifier: Text | None = Field(None, max_length=MAX_ID)
    prompt_cache_key: Text | None = Field(None, max_length=MAX_ID, description="ignored: see cache_salt")
    service_tier: Text | None = Field(None, max_length=MAX_ID)
    stream_options: dict[str, bool] | None = None
    # Not implemented: a 400 unless off.
    reasoning: Any = None
    include: Any = None
    background: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    prompt_cache_retention: Any = None
    context_management: Any = None
    # hybridserve extensions
    cache_salt: CacheSalt = Field("", description="isolates cached state; another salt never shares it")
    deterministic: StrictBool = Field(False, description="bit-identical output whatever else is batched")

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
    def _fits(self) -> "ResponsesRequest":
        check_min_tokens(self.min_tokens, self.max_output_tokens)
        if self.conversation is not None and self.previous_response_id is not None:
            raise field_error("conversation", "conversation and previous_response_id cannot both be given")
        if self.conversation is not None and not self.store:
            raise field_error("store", "a conversation's responses are stored: store must be true")
        choice, fmt = self.tool_choice, self.text.format if self.text is not None else None
        check_tool_choice([t.name for t in self.tools or ()], choice,
                          choice.name if isinstance(choice, FunctionChoice) else None,
                          fmt is not None and fmt.type != "text", "text")
        return self

    @property
    def conversation_id(self) -> str | None:
        conv = self.conversation
        return conv.id if isinstance(conv, ConversationParam) else conv

    def engine_tools(self) -> tuple[dict[str, Any], ...]:
        return tuple(t.as_engine() for t in self.tools or ())

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def constraint(self) -> dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):  # the chat shape reply_constraint reads
            choice = {"type": "function", "function": {"name": choice.name}}
        fmt = self.text.format if self.text is not None else None
        return reply_constraint(list(self.engine_tools()), choice, self.parallel_tool_calls is not False,
                                fmt.type if fmt is not None else "text",
                                fmt.schema_ if fmt is not None and fmt.type == "json_schema" else None,
                                bool(getattr(fmt, "strict", False)))

    def sampling(self, max_output_tokens: int) -> dict:
        return {"max_tokens": min(self.max_output_tokens or max_output_tokens, max_output_tokens),
                "temperature": self.temperature, "top_p": self.top_p, "seed": None, "stop": (), "logprobs": None,
                "deterministic": self.deterministic, "constraint": self.constraint(), **self.vllm_sampling()}

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response object repeats them."""
        choice = self.tool_choice
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "temperature": self.temperature, "top_p": self.top_p, "store": self.store,
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
            "text": (self.text or TextConfig()).echo(), "truncation": "disabled",
            "user": self.user, "reasoning": None, "background": False, "service_tier": "default",
        }


class ConversationCreate(RequestModel):
    """`POST /v1/conversations`. A conversation of this server exists once its first turn is
    committed, so initial items (which would need a turn without a reply) are refused."""


    items: list[Any] | None = Field(None, description="refused unless empty")
    metadata: dict[str, Text] | None = Field(None, max_length=16)

    @field_validator("items")
    @classmethod
    def _no_items(cls, value: Any) -> Any:
        if value:
            raise field_error("items", "initial items are not supported: send them as the first response's input")
        return value


class ItemsCreate(RequestModel):
    """`POST /v1/conversations/{id}/items`: up to 20 items (OpenAI's limit) appended to a stored
    conversation without a reply; the next turn's prompt has them before its own input."""

    items: list[InputItem] = Field(min_length=1, max_length=20)
    include: list[Any] | None = Field(None, description="the extra output fields of items: none exist here")

    @field_validator("include")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        if not _off(value):
            raise _unsupported("include")
        return value
