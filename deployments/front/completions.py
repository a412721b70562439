"""OpenAI's legacy completions (`POST /v1/completions`): a raw prompt, no chat template.

    request     prompt: text, token ids, or a list holding one of either; max_tokens (default 16,
                as OpenAI's and vLLM's), temperature, top_p, seed, stop, stream, stream_options,
                logprobs (k: the sampled token's and the top k), echo, cache_salt, deterministic,
                vLLM's structured outputs, priority (structured_outputs.py) and prompt_logprobs
    answer      {"object": "text_completion", choices: [{text, index, logprobs, finish_reason
                [, prompt_logprobs]}], usage}
    streaming   data: chunk(text)* data: chunk("", finish_reason) [data: chunk([], usage)] data: [DONE]

`echo` opens the text with the prompt (token ids: their text); with `logprobs` the legacy lists
cover the prompt's tokens first (the first token's logprob null), then the reply's: what lm-eval's
log-likelihood tasks read (prompt_logprobs.py). `max_tokens: 0` with `echo` answers the prompt
alone: as vLLM does, the engine samples one token, which the answer leaves out (usage counts 0).
vLLM's `prompt_logprobs: k` adds the choice's `prompt_logprobs` in vLLM's shape (not streamed,
as vLLM refuses it there). A request wanting the prompt's logprobs reuses no cached prefix: its
prompt runs whole (workers/prompt_logprobs.py).

It runs as a stateless chat request does (workers' stream_completion): the longest prefix of its
prompt held on the replica under its cache_salt is reused, and its end is kept for the next.
`n` replies (up to 16) share one prefill, as in chat; the prompt is every choice's: each choice
opens with its echo (and, asked, its prompt logprobs and `prompt_logprobs`), computed once.
Refused by name (400): more than one prompt, `n` above 16, `best_of` above 1, `suffix`,
`max_tokens: 0` without `echo`, `prompt_logprobs` with `stream`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from deployments.errors import APIError
from deployments.front.chat_format import SSE_DONE, choice_ends, data, usage_of
from deployments.front.chat_models import (MAX_ID, MAX_STOP, CacheSalt, LogitBias, Penalty,
                                           StopString, StreamOptions, Text, _off, _unsupported)
from deployments.front.request_base import field_error
from deployments.front.sampling_fields import (MAX_CHOICES, check_choices, check_min_tokens, processor_sampling,
                                              special_tokens_sampling, vllm_sampling)
from deployments.front import vllm_fields
from deployments.front.prompt_logprobs import legacy_prompt_logprobs, vllm_prompt_logprobs
from deployments.front.structured_outputs import StructuredOutputFields
from deployments.front.vllm_sampling import VllmTextFields
from deployments.messages import PromptLogprob, TokenLogprob, TurnDelta, TurnDone

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions (chat's is what the context leaves)
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
UNSUPPORTED = ("suffix",)


class CompletionRequest(StructuredOutputFields, VllmTextFields):
    model: Text = Field(max_length=MAX_ID)
    prompt: (Text | TokenIds | Annotated[list[Text], Field(min_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1)])
    max_tokens: StrictInt = Field(DEFAULT_MAX_TOKENS, ge=0)  # clamped to max_output_tokens and the context; 0: echo only
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=1 << 63)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)  # vLLM's
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES, description="replies, forked from one prefill")
    best_of: StrictInt = Field(1, ge=1, le=1, description="only 1 is supported")
    user: Text | None = Field(None, max_length=MAX_ID)
    presence_penalty: Penalty = 0.0  # (as in chat_models)
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    # Not implemented: a 400 unless off.
    suffix: Any = None
    # vLLM's extensions (its sampling ones: VllmTextFields)
    request_id: Text | None = Field(None, min_length=1, max_length=MAX_ID, description="the reply's id: cmpl-<it>")
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

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > 1:
                raise field_error("prompt", "one prompt per request (send a request per prompt)")
            return value[0]
        return value

    @model_validator(mode="after")
    def _echo_fits(self) -> "CompletionRequest":
        check_min_tokens(self.min_tokens, self.max_tokens)
        check_choices(self.n, self.deterministic)
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "max_tokens 0 answers nothing without echo")
        if self.stream and self.prompt_logprobs is not None:
            raise field_error("prompt_logprobs", "prompt_logprobs is not available when streaming")
        return self

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The top k the engine computes for each prompt token (None: none)."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def engine_prompt(self) -> str | tuple[int, ...]:
        return self.prompt if isinstance(self.prompt, str) else tuple(self.prompt)

    def sampling(self, max_output_tokens: int) -> dict:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"max_tokens": max(1, min(self.max_tokens, max_output_tokens)), "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed, "stop": tuple(s for s in stop if s),
                "logprobs": self.logprobs, "prompt_logprobs": self.engine_prompt_logprobs,
                "deterministic": self.deterministic, "n": self.n,
                "constraint": self.structured_constraint(), "priority": self.priority,
                **vllm_sampling(self.top_k, self.min_p, self.stop_token_ids, self.ignore_eos,
                                self.include_stop_str_in_output),
                **processor_sampling(self), **special_tokens_sampling(self)}


def logprobs_of(entries: Iterable[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy shape: parallel lists, `text_offset` the position of each token in the text."""
    tokens, offsets = [], []
    entries = list(entries)
    for e in entries:
        offsets.append(offset)
        tokens.append(e.token)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}


@dataclass
class CompletionFormat:
    """The bodies of one completion. `echo`: the prompt's text the reply's text follows;
    `echo_logprobs`: the top k of the prompt's legacy logprobs (None: the prompt's are not listed);
    `prompt_logprobs`: vLLM's field's k; `prompt_only`: max_tokens 0 (the reply is left out)."""

    request_id: str
    model: str
    with_logprobs: bool
    echo: str = ""
    echo_logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_only: bool = False
    choices: int = 1  # n
    _offsets: dict[int, int] = field(default_factory=dict)  # streamed: where each choice's next delta's text starts

    @classmethod
    def of(cls, body: CompletionRequest, request_id: str, model: str, echo_text: str) -> "CompletionFormat":
        return cls(request_id, model, body.logprobs is not None, echo_text if body.echo else "",
                   body.logprobs if body.echo else None, body.prompt_logprobs, body.max_tokens == 0, body.n)

    def completion(self, texts: list[str], entries: list[list[TokenLogprob]], prompt: tuple[PromptLogprob, ...] | None,
                   done: TurnDone) -> dict[str, Any]:
        """The whole answer; `texts` and `entries` by choice index (the prompt, its echo and its
        logprobs, is every choice's)."""
        choices = []
        for end, text, logprobs in zip(choice_ends(done), texts, entries):
            if self.prompt_only:
                text, logprobs = "", []
            choice = {"index": end.index, "text": self.echo + text, "finish_reason": self._reason(end.finish_reason),
                      "logprobs": None}
            if self.with_logprobs:
                choice["logprobs"] = self._logprobs(prompt, logprobs, len(self.echo))
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt or (), self.prompt_logprobs)
            choices.append(choice)
        return self.envelope(choices, self._usage(done))

    def _logprobs(self, prompt: tuple[PromptLogprob, ...] | None, entries: list[TokenLogprob],
                  offset: int) -> dict[str, list]:
        reply = logprobs_of(entries, offset)
        if self.echo_logprobs is None or prompt is None:
            return reply
        listed = legacy_prompt_logprobs(prompt, self.echo_logprobs)
        return {name: listed[name] + reply[name] for name in reply}

    def start(self) -> Iterable[str]:
        self._offsets.update({i: len(self.echo) for i in range(self.choices)})
        if not self.echo or self.echo_logprobs is not None:  # with its logprobs: once they come
            return []
        return [data(self.envelope([self._choice(i, self.echo)])) for i in range(self.choices)]

    def delta(self, delta: TurnDelta) -> Iterable[str]:
        chunks = []
        if delta.prompt_logprobs and self.echo and self.echo_logprobs is not None:
            # choice 0's first delta carries them, before any other choice's (they fork from its prompt)
            echoed = self._logprobs(delta.prompt_logprobs, [], 0)
            chunks += [data(self.envelope([{**self._choice(i, self.echo), "logprobs": echoed}]))
                       for i in range(self.choices)]
        if self.prompt_only or not (delta.text or delta.logprobs):
            return chunks
        choice = self._choice(delta.index, delta.text)
        offset = self._offsets.get(delta.index, len(self.echo))
        if self.with_logprobs:
            choice["logprobs"] = logprobs_of(delta.logprobs or (), offset)
        self._offsets[delta.index] = offset + len(delta.text)
        return chunks + [data(self.envelope([choice]))]

    def end(self, done: TurnDone, include_usage: bool) -> Iterator[str]:
        for end in choice_ends(done):  # one finish_reason per choice
            reason = self._reason(end.finish_reason)
            yield data(self.envelope([{**self._choice(end.index, ""), "finish_reason": reason}]))
        if include_usage:
            yield data(self.envelope([], self._usage(done)))
        yield SSE_DONE

    def _reason(self, finish_reason: str) -> str:
        return "length" if self.prompt_only else finish_reason  # max_tokens 0 ended it

    def _usage(self, done: TurnDone) -> dict:
        usage = usage_of(done)
        if self.prompt_only:  # the one token sampled is not the client's
            usage.update(completion_tokens=0, total_tokens=done.prompt_tokens)
        return usage

    @staticmethod
    def _choice(index: int, text: str) -> dict[str, Any]:
        return {"index": index, "text": text, "finish_reason": None, "logprobs": None}

    def envelope(self, choices: list, usage: dict | None = None) -> dict[str, Any]:
        return {"id": self.request_id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": choices, "usage": usage}


@dataclass
class CompletionStream:
    """A completion's chunks as an EventStream (streams.py)."""

    form: CompletionFormat
    include_usage: bool

    def start(self) -> Iterable[str]:
        return self.form.start()

    def delta(self, delta: TurnDelta) -> Iterable[str]:
        return self.form.delta(delta)

    def end(self, done: TurnDone) -> Iterable[str]:
        return self.form.end(done, self.include_usage)

    def error(self, error: APIError) -> Iterable[str]:
        return [data(error.body())]
