"""Sampling parameters and the sampler.

A sampled token is a pure function of (seed, position, logits): the random draw for the
token at position p of a request with seed s comes from a generator seeded by mix(s, p),
never from a shared stream. Re-running a position (a preempted request, a verify pass in
deterministic mode, another replica) therefore draws the same token from the same logits.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch

from workers.errors import InvalidRequestError
from workers.grammar.constraint import Constraint
from workers.logits_processors import TokenHistory, apply_processors

MAX_LOGPROBS = 20
MAX_CHOICES = 16  # n: replies of one request, forked from its one prefill (workers/loop/forks.py)
MAX_PENALTY = 2.0  # presence and frequency: OpenAI's range [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range [-100, 100]
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one (0 disables)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: the reply ends with the stop string it matched
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the top k
    # vLLM's: None, or k >= 0: each prompt token's logprob (but the first's), its rank and the top k
    # (workers/prompt_logprobs.py; what `echo` with `logprobs` on completions needs)
    prompt_logprobs: int | None = None
    # Bit-identical output whatever else is batched (decode-verify-rollback; see DETERMINISM).
    deterministic: bool = False
    # The grammar the reply must follow (workers/grammar): a Constraint, or its wire dict.
    constraint: Constraint | None = None
    # Logits processors (logits_processors.py), as vLLM's fields of the same names mean them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 disables
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is taken too
    min_tokens: int = 0  # EOS and stop_token_ids held back (and stop strings not matched) until then
    # Not sampling but scheduling (vLLM passes it beside its SamplingParams; here it rides with
    # them over the wire): lower is admitted earlier (workers/scheduler.py).
    priority: int = 0
    # How the reply's text reads its special tokens (vLLM's; the detokenizer's, not the sampler's).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # How many replies (OpenAI's `n`): choice i samples with seed + i (each its own random seed
    # when unseeded); the prompt is computed once and its state forked (workers/loop/forks.py).
    n: int = 1
    resolved_seed: int = field(default=0, init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "constraint", Constraint.of(self.constraint))
        if isinstance(self.stop, str):  # OpenAI allows a bare string
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        problems = []
        for name in ("max_tokens", "top_k", "logprobs", "prompt_logprobs", "seed", "min_tokens", "priority", "n"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                problems.append(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                problems.append(f"{name} must be a number, got {value!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or isinstance(b, bool) or not isinstance(b, (int, float))
               for t, b in self.logit_bias):
            problems.append("logit_bias maps integer token ids to numbers")
        for name in ("deterministic", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if problems:
            raise InvalidRequestError("; ".join(problems))
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            problems.append(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 disables), got {self.top_k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                problems.append(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                problems.append(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            problems.append(f"repetition_penalty must be a finite number > 0 (1 disables), got {self.repetition_penalty!r}")
        if any(t < 0 for t, _ in self.logit_bias):
            problems.append("logit_bias token ids must be >= 0")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            problems.append(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            problems.append(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not 1 <= self.n <= MAX_CHOICES:
            problems.append(f"n must be in [1, {MAX_CHOICES}], got {self.n!r}")
        elif self.n > 1 and self.deterministic:
            problems.append("n > 1 is not served in deterministic mode (ask for the choices one request each)")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            problems.append(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            problems.append("stop_token_ids must be integers")
        if problems:
            raise InvalidRequestError("; ".join(problems))
        if self.seed is not None:
            object.__setattr__(self, "resolved_seed", self.seed)
        else:
            # From the OS, not Python's global `random`: a `random.seed()` anywhere, or a fork,
            # must not make unseeded requests repeat each other.
            object.__setattr__(self, "resolved_seed", secrets.randbits(63))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes(self) -> bool:
        """Whether a logits processor changes this request's logits (it then needs its TokenHistory)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    def stops_at(self, token_id: int, eos_token_ids: frozenset[int] | tuple[int, ...], num_generated: int) -> bool:
        """Whether `token_id`, the reply's num_generated-th token, ends it as a stop token (vLLM's
        check_stop): one of stop_token_ids, or an end of sequence unless ignore_eos, once the
        reply has min_tokens. Its own text is then left out of the reply unless
        include_stop_str_in_output asks for it, as vLLM's detokenizer leaves it out."""
        ends_here = token_id in self.stop_token_ids or (token_id in eos_token_ids and not self.ignore_eos)
        return ends_here and num_generated >= self.min_tokens


def check_logit_bias(params: SamplingParams, vocab: int) -> None:
    """logit_bias names tokens of this model's vocabulary (known only where the model is)."""
    outside = [t for t, _ in params.logit_bias if t >= vocab]
    if outside:
        raise InvalidRequestError(f"logit_bias: token ids outside the vocabulary (0..{vocab - 1}): {outside[:5]}")


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): independent draws per position, same draw on replay."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _draw(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    scaled = logits.double() / params.temperature
    order = torch.argsort(scaled, descending=True, stable=True)
    sorted_logits = scaled[order]
    if params.top_k:
        sorted_logits[params.top_k :] = -torch.inf
    probs = torch.softmax(sorted_logits, dim=-1)
    if params.min_p > 0.0:  # relative to the likeliest token, probs[0] (sorted)
        probs = torch.where(probs >= params.min_p * probs[0], probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = torch.cumsum(probs, dim=-1) - probs
        probs = torch.where(before < params.top_p, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    generator = torch.Generator().manual_seed(_mix(params.resolved_seed, position))
    u = torch.rand((), generator=generator, dtype=torch.float64)
    index = int(torch.searchsorted(torch.cumsum(probs, dim=-1), u * probs.sum(), right=True))
    index = min(index, int((probs > 0).sum()) - 1)
    return int(order[index])


def sample(
    logits: torch.Tensor,  # [B, V]
    params: list[SamplingParams],
    positions: list[int],  # absolute position of the token being sampled, per row
    banned_token_ids: torch.Tensor | None = None,
    overwrite: bool = False,  # the caller's logits may be masked in place (no copy of [B, V])
    allowed: list[torch.Tensor | None] | None = None,  # per row: bool [V] of a grammar, or None
    histories: list[TokenHistory | None] | None = None,  # per row whose params process (else None)
    eos_token_ids: frozenset[int] = frozenset(),  # what min_tokens holds back (with stop_token_ids)
) -> list[SampledToken]:
    if logits.dtype != torch.float32:
        logits, overwrite = logits.float(), True
    if banned_token_ids is not None and banned_token_ids.numel():
        banned_token_ids = banned_token_ids.to(logits.device)  # the tokenizer's, on the host
        if overwrite:
            logits.index_fill_(1, banned_token_ids, -torch.inf)
        else:
            logits, overwrite = logits.index_fill(1, banned_token_ids, -torch.inf), True
    if allowed is not None and any(m is not None for m in allowed):
        if not overwrite:
            logits, overwrite = logits.clone(), True
        for row, mask in enumerate(allowed):
            if mask is not None:  # grammars make masks on the host
                logits[row].masked_fill_(~mask.to(logits.device), -torch.inf)
    want_logprobs = any(p.logprobs is not None for p in params)
    # Logprobs are the model's (masked) distribution, before the processors: vLLM's raw logprobs.
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if any(p.processes for p in params):
        if not overwrite:
            logits = logits.clone()
        apply_processors(logits, params, histories or [None] * len(params), eos_token_ids, allowed)
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    if all(p.greedy and p.logprobs is None for p in params):  # the common decode batch: one argmax
        return [SampledToken(token, None, None) for token in greedy_ids]
    out = []
    for row, (p, pos) in enumerate(zip(params, positions)):
        # A seeded draw runs on the host whatever the logits' device: its generator is the
        # CPU's, so a seed draws the same token from the same logits on any device.
        token = greedy_ids[row] if p.greedy else _draw(logits[row].cpu(), p, pos)
        if p.logprobs is None:
            out.append(SampledToken(token, None, None))
            continue
        row_lp = logprobs[row]
        top = ()
        if p.logprobs:
            values, ids = torch.topk(row_lp, p.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        out.append(SampledToken(token, float(row_lp[token]), top))
    return out
