"""Our requests in vLLM's terms and back: SamplingParams -> vLLM's sampling arguments, the
engine host's frames -> our RequestOutput (text made here, by our detokenizer, so stop strings,
tool-call parsing and logprob text behave as on our engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.detokenizer import detokenizer_for
from workers.engine import RequestOutput
from workers.errors import InvalidRequestError
from workers.grammar.constraint import ConstraintKind
from workers.request import FinishReason, ReuseSource
from workers.sampling import SampledToken, SamplingParams, check_logit_bias
from workers.tokenizer import ChatTokenizer
from workers.tools.formats import ToolFormat
from workers.vllm_backend.structured import structured_outputs

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def vocabulary(tokenizer: ChatTokenizer, model_dir: str) -> tuple[int, list[int] | None, frozenset[int]]:
    """(the vocabulary's size; the ids vLLM may sample: all but the control ids, None if there
    are none; the ids that end a turn, the config's and the tokenizer's)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    banned = set(tokenizer.never_sample_ids)
    allowed = [i for i in range(config["vocab_size"]) if i not in banned] if banned else None
    eos = config.get("eos_token_id")
    return config["vocab_size"], allowed, frozenset((eos if isinstance(eos, list) else [eos] if eos is not None else [])
                              + list(tokenizer.eos_token_ids()))


def backend_params(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """`params` as this backend runs them; what it does not do is refused before anything runs
    (a 400). Constraints run as vLLM's structured outputs (structured.py)."""
    check_logit_bias(params, vocab_size)
    if params.deterministic:
        raise InvalidRequestError("deterministic mode is not available on the vllm backend (run backend: ours)")
    if params.n > 1:  # one reply per turn through the host's frames (its conversations commit one reply)
        raise InvalidRequestError("n > 1 is not available on the vllm backend (run backend: ours)")
    if params.prompt_logprobs is not None:  # the host's frames carry no prompt logprobs yet
        raise InvalidRequestError("prompt_logprobs (and echo with logprobs) is not available on the vllm backend "
                                  "(run backend: ours)")
    if params.priority != 0:  # the host's vLLM engine schedules FCFS, where vLLM itself refuses a priority
        raise InvalidRequestError("priority is not available on the vllm backend (run backend: ours)")
    return params


def vllm_sampling(params: SamplingParams, allowed_token_ids: list[int] | None,
                  tool_format: ToolFormat | None = None) -> dict[str, Any]:
    """vLLM SamplingParams arguments for `params` (greedy at temperature 0, as ours); a constraint
    of tool calls needs the template's `tool_format`."""
    args: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,
        "min_p": params.min_p,
        "seed": params.resolved_seed if params.temperature > 0 else None,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
        # vLLM's own logits processors mean these as ours do (workers/logits_processors.py).
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "min_tokens": params.min_tokens,
    }
    if params.logit_bias:
        args["logit_bias"] = dict(params.logit_bias)
    if params.stop:  # vLLM ends the request where the stop string completes (its detokenizer runs)
        args.update(stop=list(params.stop), detokenize=True)
    else:
        args["detokenize"] = False
    if params.logprobs is not None:
        args["logprobs"] = params.logprobs
    if allowed_token_ids is not None:
        args["allowed_token_ids"] = allowed_token_ids
    if params.constraint is not None:
        assert tool_format is not None or params.constraint.kind is not ConstraintKind.TOOL_CALLS
        args["structured_outputs"] = structured_outputs(params.constraint, tool_format)
    return args


class OutputStream:
    """Turns one request's frames into RequestOutputs."""

    def __init__(self, request_id: str, tokenizer: ChatTokenizer, params: SamplingParams, num_prompt_tokens: int,
                 eos_token_ids: frozenset[int]):
        self.request_id = request_id
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.output_ids: list[int] = []
        self._detok = detokenizer_for(tokenizer, params)
        self._stopped = False

    def output(self, frame: dict[str, Any], turn_commit: Any = None, *, reused: ReuseSource = ReuseSource.HEAD,
               checkpoints: tuple[tuple[int, int], ...] = (), checkpoint_keys: tuple = ()) -> RequestOutput:
        """reused: where a loaded state came from (a conversation's head, or a prefix checkpoint);
        checkpoints: on the last frame, those the request left (RequestOutput.checkpoints), and
        checkpoint_keys their names."""
        logprobs = frame.get("logprobs") or [None] * len(frame["tokens"])
        tokens, text = [], ""
        finished = frame["finished"]
        last = len(frame["tokens"]) - 1
        for i, (token_id, lp) in enumerate(zip(frame["tokens"], logprobs, strict=True)):
            self.output_ids.append(token_id)
            tokens.append(SampledToken(token_id, None if lp is None else lp[0],
                                       None if lp is None else tuple((t, v) for t, v in lp[1][: self.params.logprobs])))
            if finished and i == last and frame["reason"] == "stop" and not self.params.include_stop_str_in_output \
                    and self.params.stops_at(token_id, self.eos_token_ids, len(self.output_ids)):
                continue  # the stop token vLLM ended the reply on: its text is not the reply's (as ours)
            if not self._stopped:
                delta, self._stopped = self._detok.update(token_id)
                text += delta
        if finished and not self._stopped:
            text += self._detok.flush()
        cached = frame["cached"]
        return RequestOutput(
            self.request_id, tuple(tokens), text, finished,
            _REASONS.get(frame["reason"], FinishReason.ERROR) if finished else None,
            self.num_prompt_tokens, cached, error=frame.get("error"), seed=self.params.resolved_seed,
            turn_commit=turn_commit, checkpoints=checkpoints, checkpoint_keys=checkpoint_keys,
            reused_from=reused if cached else ReuseSource.NONE)
