"""vLLM's /tokenize and /detokenize bodies (its server's shapes): a raw prompt or chat messages
to token ids (what a completion or a chat request of them runs), and token ids back to text."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictBool, model_validator

from deployments.front.chat_models import MAX_ID, MAX_MESSAGES, ChatMessage, Text
from deployments.front.sampling_fields import template_options
from workers.template_options import TemplateOptions
from deployments.front.request_base import RequestModel


class TokenizeRequest(RequestModel):
    model: Text | None = Field(None, max_length=MAX_ID)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = Field(False, description="accepted; the prompt is tokenized as a completion runs it")

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        self.template_options()  # refuses what a chat request refuses
        return self

    def template_options(self) -> TemplateOptions:
        """The messages rendered as a stateless chat request with these fields runs them."""
        last_role = self.messages[-1].role if self.messages else "assistant"  # (a prompt: not rendered)
        return template_options(self.chat_template_kwargs, self.add_generation_prompt, self.continue_final_message,
                                last_role, False)


class DetokenizeRequest(RequestModel):
    model: Text | None = Field(None, max_length=MAX_ID)
    tokens: list[Annotated[int, Field(ge=0)]]
