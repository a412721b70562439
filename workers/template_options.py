"""How a chat request asks the chat template to render its messages: vLLM's request fields
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`, as its server
means them (pure data: it crosses from the ingress to a worker in a TurnJob).

    add_generation_prompt=True             ... <|end_of_turn|><|start_of_role|>assistant<|end_of_role|>
    add_generation_prompt=False            ... <|end_of_turn|>            (the model opens a turn itself)
    continue_final_message=True            ... <|start_of_role|>assistant<|end_of_role|>Hel
                                           (the last assistant message left open: the model continues it)

`kwargs` are extra variables of the template's render (e.g. `enable_thinking`). A key naming one
of the render's own variables is refused where the request is read (RESERVED_KWARGS), as vLLM
refuses `chat_template` and `tokenize`: its value would silently replace what the request says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The render's own variables (transformers' apply_chat_template parameters and the tokenizer's
# special-token names it passes the template): a chat_template_kwargs key among them is a 400.
RESERVED_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding",
    "truncation", "max_length", "return_tensors", "bos_token", "eos_token", "unk_token", "sep_token",
    "pad_token", "cls_token", "mask_token", "additional_special_tokens", "raise_exception", "strftime_now",
})


@dataclass(frozen=True)
class TemplateOptions:
    kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        assert not (self.add_generation_prompt and self.continue_final_message), "checked at the ingress"
        assert not RESERVED_KWARGS & self.kwargs.keys(), "checked at the ingress"

    @property
    def opens_reply(self) -> bool:
        """The prompt ends with the generation prompt: the reply is a new assistant message (what
        a conversation turn needs, its reply being committed as one)."""
        return self.add_generation_prompt and not self.continue_final_message


DEFAULT_TEMPLATE = TemplateOptions()
