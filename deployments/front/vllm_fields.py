"""vLLM's request fields this server does not serve yet, and what becomes of fields nobody knows.

A vLLM field at its default (or null) is accepted: it asks for nothing. Any other value is a 400
naming the field (`unsupported_parameter`), never silently ignored, whatever `unknown_fields`
says: a client sending `length_penalty: 1.2` must learn that it was not applied.

Fields neither OpenAI nor vLLM define are refused (400, OpenAI's behaviour) unless the
deployment sets `unknown_fields: log`: then they are dropped and logged, as vLLM's server does.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic_core import PydanticCustomError

from deployments.settings import UnknownFields

log = logging.getLogger("hybridserve.ingress")

# vLLM's OpenAI-server extensions not served here, with the value that asks for nothing
# (structured outputs and priority are served: structured_outputs.py). A request model that
# declares one serves it (known fields pass first): the chat template's fields are chat's, and
# stay listed here for the legacy completions, which have no template.
NOT_SERVED: dict[str, Any] = {
    "length_penalty": 1.0, "use_beam_search": False,
    "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": [],
    "add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {},
    "add_special_tokens": False, "documents": None, "chat_template": None, "mm_processor_kwargs": None,
    "logits_processors": None, "return_tokens_as_token_ids": None, "return_token_ids": None,
    "kv_transfer_params": None, "vllm_xargs": None,
}


class Leniency:
    """The deployment's choice, set once by ChatIngress.__init__ (request models are classes:
    FastAPI gives their validators no other way to read a setting)."""

    unknown_fields: UnknownFields = UnknownFields.REFUSE


def screen(model: type, data: Any) -> Any:
    """A top-level request body before validation: vLLM fields not served refused unless at their
    default (and then dropped), unknown ones dropped and logged if the deployment says so."""
    if not isinstance(data, dict):
        return data
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    kept = {}
    for name, value in data.items():
        if name in known:
            kept[name] = value
        elif name in NOT_SERVED:
            if value is not None and value != NOT_SERVED[name]:
                raise PydanticCustomError("unsupported", "{field} is not supported by this server", {"field": name})
        elif Leniency.unknown_fields is UnknownFields.LOG:
            log.warning("request field %r is not known: dropped (unknown_fields: log)", name)
        else:
            kept[name] = value  # refused by extra="forbid", by name
    return kept
