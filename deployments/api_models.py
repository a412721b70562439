"""The HTTP schema: OpenAI's chat completions request plus `conversation_id`, `cache_salt`,
`deterministic` and `wait_if_busy`. Pydantic validates; anything out of range is a 400."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_ID = 256
MAX_OUTPUT_TOKENS = 4096


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # bounded by the body size limit (413)
    name: str | None = Field(None, max_length=MAX_ID)

    def as_engine_message(self) -> dict[str, str]:
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        return {"role": self.role, "content": text}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(max_length=MAX_ID)
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = Field(None, max_length=4)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = Field(None, max_length=MAX_ID)
    # hybridserve extensions
    conversation_id: str | None = Field(None, min_length=1, max_length=MAX_ID,
                                        description="continue this conversation; send only the new messages")
    cache_salt: str = Field("", max_length=MAX_ID, description="isolates cached state; another salt never shares it")
    deterministic: bool = Field(False, description="bit-identical output whatever else is batched")
    wait_if_busy: bool = Field(False, description="wait for a turn in flight instead of a 409")

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
