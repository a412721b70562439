"""The checkpoint's tokenizer and chat template, plus incremental detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.errors import InvalidRequestError
from workers.template_options import DEFAULT_TEMPLATE, TemplateOptions


class ChatTokenizer:
    """Wraps the checkpoint's `transformers` tokenizer; absent files mean token ids only."""

    def __init__(self, model_dir: Path):
        self._tok = None
        if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer  # imported lazily: slow, and optional for id-only use

            self._tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self._backend = _plain_backend(self._tok)
        extra = model_dir / "hybridserve.json"
        meta = json.loads(extra.read_text()) if extra.is_file() else {}
        self.never_sample_ids: tuple[int, ...] = tuple(meta.get("never_sample_token_ids", ()))

    @property
    def available(self) -> bool:
        return self._tok is not None

    @property
    def hf(self):
        """The `transformers` tokenizer (None without tokenizer files)."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

    def _require(self):
        if self._tok is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids")
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._require().encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
               ) -> str:
        """A reply's text (vLLM's two fields: special tokens dropped unless `skip_special_tokens` is
        false; `spaces_between_special_tokens` is a slow tokenizer's, as in transformers: a fast
        tokenizer's decoder decides the spacing itself)."""
        if self._backend is not None:  # the same text without the wrapper's per-call Python (~10 us)
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._tok is None:
            return ""
        extra = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False,
                                **extra)

    def decode_exact(self, ids: list[int]) -> str:
        """Text of ids with special tokens kept: the inverse of `encode` for the template."""
        return self._require().decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def decode_request_ids(self, ids: list[int]) -> str:
        """`decode_exact` of ids a client sent (/detokenize): ids outside the vocabulary are
        refused (InvalidRequestError), not handed to the tokenizer."""
        size = len(self._require())
        outside = [i for i in ids if not 0 <= i < size]
        if outside:
            raise InvalidRequestError(f"token ids outside the vocabulary (0..{size - 1}): {outside[:5]}")
        return self.decode_exact(ids)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, *, kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False) -> str:
        """`kwargs`: the request's chat_template_kwargs; `continue_final_message`: the last
        message is left open (transformers cuts the render after its content)."""
        tok = self._require()
        if "developer" not in (self.chat_template or ""):
            # OpenAI's newer name of the system role: a template that does not know it gets "system"
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=list(tools) if tools else None,
                                           continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as e:  # jinja raises for malformed messages (missing role, bad content)
            raise InvalidRequestError(f"cannot render messages with the chat template: {e}") from e

    def request_ids(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                    template: TemplateOptions = DEFAULT_TEMPLATE) -> list[int]:
        """The token ids of a raw prompt (as a completion runs it) or of messages rendered by the
        chat template (as a chat request of them with these `template` options runs them): what
        /tokenize answers."""
        if messages is not None:
            return self.encode(self.render(messages, template=template))
        return self.encode(prompt or "")

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               template: TemplateOptions = DEFAULT_TEMPLATE) -> str:
        """Messages rendered as a request's `template` options ask (what a chat request runs)."""
        return self.render_chat(messages, template.add_generation_prompt, tools, kwargs=template.kwargs,
                                continue_final_message=template.continue_final_message)

    def eos_token_ids(self) -> tuple[int, ...]:
        tok = self._tok
        return () if tok is None or tok.eos_token_id is None else (int(tok.eos_token_id),)


def _plain_backend(tok):
    """The `tokenizers.Tokenizer` under a transformers fast tokenizer whose decode (without
    clean-up) is exactly the backend's, or None (a slow tokenizer, or a class of its own)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    plain = (
        isinstance(tok, TokenizersBackend)
        and type(tok)._decode is TokenizersBackend._decode
        and type(tok).decode is PreTrainedTokenizerBase.decode
    )
    return tok._tokenizer if plain else None
