"""How a request's tokens become text and how it ends: the detokenizer and stop checks, the
pause after a tool call, and ending it so that nothing leaks whatever fails on the way.

Both steps (fast_step.py, verify_step.py) hand their tokens here; the engine's abort and
fail_all end requests here too.
"""

from __future__ import annotations

import logging

from workers.cache.coordinator import CacheCoordinator
from workers.detokenizer import Detokenizer, detokenizer_for
from workers.loop.grammar_masks import prefetch_mask
from workers.loop.outputs import RequestOutput, output_of
from workers.request import FinishReason, Request, RequestStatus
from workers.sampling import SampledToken
from workers.scheduler import Scheduler
from workers.tokenizer import ChatTokenizer
from workers.tools.formats import ToolFormat

log = logging.getLogger(__name__)


def ends_in_tool_call(tokenizer: ChatTokenizer, tool_format: ToolFormat, reply_ids: list[int]) -> bool:
    """Whether the reply's text ends with the end of a tool call (only its end is decoded)."""
    end_tag = tool_format.end_tag
    tail = reply_ids[-(len(end_tag) + 4):]
    if not tail or not tokenizer.available:
        return False
    text = tokenizer.decode(tail)
    return text.rstrip().endswith(end_tag)


class Finisher:
    def __init__(
        self,
        tokenizer: ChatTokenizer,
        tool_format: ToolFormat,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        scheduler: Scheduler,
        caches: CacheCoordinator,
    ):
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.caches = caches
        self._detok: dict[str, Detokenizer] = {}

    def start(self, request: Request) -> None:
        self._detok[request.request_id] = detokenizer_for(self.tokenizer, request.params)

    # -- tokens -------------------------------------------------------------------------------
    def on_token(self, request: Request, token: SampledToken) -> RequestOutput:
        """A token the client sees: appended, detokenized, checked for the end."""
        request.append(token)
        delta, reason = self.text_and_reason(request, token)
        if reason is not None:
            delta += self.flush(request)
            self.finish(request, reason)
        else:
            prefetch_mask(request)
        return output_of(request, (token,), delta)

    def text_and_reason(self, request: Request, token: SampledToken) -> tuple[str, FinishReason | None]:
        """The text the new last token adds, and why the request ends there (if it does)."""
        params = request.params
        if params.stops_at(token.token_id, self.eos_token_ids, request.num_tokens - request.num_prompt_tokens):
            # A stop token's text is the reply's only if include_stop_str_in_output (vLLM's rule)
            if not params.include_stop_str_in_output:
                return "", FinishReason.STOP
            return self._detok[request.request_id].update(token.token_id)[0], FinishReason.STOP
        delta, stopped = self._detok[request.request_id].update(token.token_id)
        if stopped:
            return delta, FinishReason.STOP
        return delta, self.finish_reason(request, token.token_id)

    def flush(self, request: Request) -> str:
        """The text held back (a possible stop string's start), at the request's end."""
        return self._detok[request.request_id].flush()

    def finish_reason(self, request: Request, token_id: int) -> FinishReason | None:
        """For the last token of request.token_ids (verified or a candidate)."""
        params = request.params
        if params.stops_at(token_id, self.eos_token_ids, request.num_tokens - request.num_prompt_tokens):
            return FinishReason.STOP
        if request.guide is not None and request.guide.ended_after(request.reply_ids):
            return FinishReason.STOP  # the grammar is complete: nothing may follow
        if request.num_tokens - request.num_prompt_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def ends(self, request: Request, token_id: int) -> bool:
        return self.finish_reason(request, token_id) is not None

    # -- the end --------------------------------------------------------------------------------
    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request; a failure while keeping its state or in its on_finished fails this
        request alone and frees its state (never the batch, never a leak)."""
        self._detok.pop(request.request_id, None)
        if request.guide is not None:
            request.guide.close()
            request.guide = None
        for choice in list(request.forks):  # n > 1: choices not forked yet end with it (they hold nothing)
            request.forks.remove(choice)
            self.finish(choice, reason)
        request.awaiting_tool = reason is FinishReason.STOP and ends_in_tool_call(
            self.tokenizer, self.tool_format, request.reply_ids)
        try:
            self.scheduler.finish(request, reason)
        except Exception as e:
            self._failed_finish(request, e)  # on_finished still runs: it sees no prepared state
        if request.on_finished is None:
            return
        try:
            request.finish_record = request.on_finished(request)
        except Exception as e:
            self._failed_finish(request, e)

    def _failed_finish(self, request: Request, error: Exception) -> None:
        log.exception("request %s: finishing failed", request.request_id)
        prepared = request.prepared
        if prepared is not None and prepared.holder in self.caches.heads.prepared:
            self.caches.heads.release(prepared)
        request.prepared = None
        self.caches.discard(request)  # whatever the request still holds
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ERROR
        request.finish_error = f"finishing the request failed: {error}"

    def fail(self, request: Request, message: str, invalid: bool = False) -> RequestOutput:
        """End the request with an error (`invalid`: its own input's doing, see RequestOutput)."""
        self.finish(request, FinishReason.ERROR)
        return output_of(request, (), "", error=message, invalid=invalid)
