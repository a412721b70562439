"""The request fields chat completions and completions share that become SamplingParams or
template options: vLLM's extensions, the logits processors' fields, how special tokens read,
and the chat template's rendering fields, checked as vLLM's server checks them."""

from __future__ import annotations

from typing import Any

from deployments.front.request_base import field_error

# `n`: replies per request, forked from one prefill (the engine's cap, workers/sampling.py MAX_CHOICES)
MAX_CHOICES = 16
from workers.template_options import RESERVED_KWARGS, TemplateOptions


def vllm_sampling(top_k: int | None, min_p: float | None, stop_token_ids: list[int] | None,
                  ignore_eos: bool, include_stop_str_in_output: bool) -> dict[str, Any]:
    """SamplingParams fields of vLLM's request extensions (chat and completions alike)."""
    return {"top_k": max(0, top_k or 0), "min_p": min_p or 0.0, "stop_token_ids": tuple(stop_token_ids or ()),
            "ignore_eos": ignore_eos, "include_stop_str_in_output": include_stop_str_in_output}


def processor_sampling(request: Any) -> dict[str, Any]:
    """SamplingParams fields of the logits processors (chat and completions alike): the penalties,
    logit_bias (its string keys as token ids; ids outside the vocabulary are refused where the
    model is) and min_tokens."""
    return {"presence_penalty": request.presence_penalty, "frequency_penalty": request.frequency_penalty,
            "repetition_penalty": request.repetition_penalty, "min_tokens": request.min_tokens,
            "logit_bias": {int(token): bias for token, bias in (request.logit_bias or {}).items()}}


def special_tokens_sampling(request: Any) -> dict[str, Any]:
    """SamplingParams fields of how the reply's special tokens read (chat and completions alike)."""
    return {"skip_special_tokens": request.skip_special_tokens,
            "spaces_between_special_tokens": request.spaces_between_special_tokens}


def template_options(kwargs: dict[str, Any] | None, add_generation_prompt: bool, continue_final_message: bool,
                     last_role: str, in_conversation: bool) -> TemplateOptions:
    """vLLM's rendering fields checked as its server checks them (both flags true: a 400; the
    template's own variables in chat_template_kwargs: a 400, where vLLM refuses `chat_template`
    and `tokenize` and quietly overrides the rest). A conversation turn must open its reply: its
    reply is committed as a new assistant message, and the next turn re-renders the history
    from the ledger, where an assistant message continued in place (or a reply without the
    generation prompt) would render otherwise than the tokens the head holds."""
    if continue_final_message and add_generation_prompt:
        raise field_error("continue_final_message",
                           "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if continue_final_message and last_role != "assistant":
        raise field_error("continue_final_message", "continue_final_message needs the last message to be the "
                                                     "assistant's (the reply continues it)")
    if in_conversation and not (add_generation_prompt and not continue_final_message):
        field = "continue_final_message" if continue_final_message else "add_generation_prompt"
        raise field_error(field, f"{field} cannot be used in a conversation turn (its reply is committed as a new "
                                  "assistant message); send the whole history without conversation_id")
    reserved = sorted(RESERVED_KWARGS & (kwargs or {}).keys())
    if reserved:
        raise field_error("chat_template_kwargs", f"chat_template_kwargs cannot set the template's own "
                                                   f"variables: {', '.join(reserved)}")
    return TemplateOptions(dict(kwargs or {}), add_generation_prompt, continue_final_message)


def check_min_tokens(min_tokens: int, max_tokens: int | None) -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        raise field_error("min_tokens", f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})")


def check_choices(n: int, deterministic: bool) -> None:
    """n > 1 in deterministic mode is a 400: each choice would need its own verified replay."""
    if n > 1 and deterministic:
        raise field_error("n", "n > 1 is not served in deterministic mode (send one request per reply)")
