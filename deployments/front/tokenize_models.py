"""vLLM's /tokenize and /detokenize bodies (its server's shapes): a raw prompt or chat messages
to token ids (what a completion or a chat request of them runs), and token ids back to text."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from deployments.front.chat_models import MAX_ID, MAX_MESSAGES, ChatMessage, Text
from deployments.front.request_base import RequestModel


class TokenizeRequest(RequestModel):
    model: Text | None = Field(None, max_length=MAX_ID)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool = Field(False, description="accepted; the prompt is tokenized as a completion runs it")

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(RequestModel):
    model: Text | None = Field(None, max_length=MAX_ID)
    tokens: list[Annotated[int, Field(ge=0)]]
