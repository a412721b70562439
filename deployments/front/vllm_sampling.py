"""vLLM's sampling extensions, declared once for every endpoint that takes them: chat completions
and completions (VllmTextFields: with include_stop_str_in_output, since they take stop strings)
and the Responses API (VllmSamplingFields: top_k, min_p, stop_token_ids, ignore_eos,
repetition_penalty, min_tokens, skip_special_tokens, spaces_between_special_tokens and
priority), meaning what vLLM's server means. A Response's id names its conversation turn
(responses_plan.ResponseId), so vLLM's `request_id` is not taken there (400, by name).

    priority    lower is admitted first (workers/scheduler.py); any int64
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from deployments.front.request_base import RequestModel
from deployments.front.sampling_fields import special_tokens_sampling, vllm_sampling
from deployments.front.structured_outputs import INT64

MAX_STOP_TOKEN_IDS = 64
RepetitionPenalty = Annotated[StrictFloat, Field(gt=0.0, allow_inf_nan=False)]


class VllmSamplingFields(RequestModel):
    """The fields, as a base of a request model."""

    top_k: StrictInt | None = Field(None, ge=-1, description="sample among the k likeliest tokens; -1 or 0: all")
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0, description="drop tokens less likely than min_p x the "
                                                                  "likeliest")
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = Field(False, description="go on past the end-of-sequence token (to the reply's limit)")
    repetition_penalty: RepetitionPenalty = Field(1.0, description="tokens of the prompt or reply: logit / p if "
                                                                   "positive, else x p (1: off)")
    min_tokens: StrictInt = Field(0, ge=0, description="no EOS, stop token or stop string ends the reply before")
    skip_special_tokens: StrictBool = Field(True, description="false: the reply's special tokens stay in its text")
    spaces_between_special_tokens: StrictBool = Field(True, description="false: no space between two special "
                                                                        "tokens where the decoder would put one")
    priority: StrictInt = Field(0, ge=-INT64, lt=INT64, description="lower is admitted earlier (vLLM's meaning)")

    def vllm_sampling(self) -> dict[str, Any]:
        """Their SamplingParams fields, for the Responses API (no stop strings there: none is
        included; chat and completions map theirs beside their other fields)."""
        return {**vllm_sampling(self.top_k, self.min_p, self.stop_token_ids, self.ignore_eos, False),
                "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
                "priority": self.priority, **special_tokens_sampling(self)}


class VllmTextFields(VllmSamplingFields):
    """The fields of the endpoints that take stop strings (chat completions and completions)."""

    include_stop_str_in_output: StrictBool = Field(False, description="end the reply with the stop string (or stop "
                                                                      "token) that ended it, else cut before it")
