"""The serving benchmark's plans and workloads: conversations of synthetic chat."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.kit.chat_client import Script
from bench.kit.chat_text import chat_text, scripted_conversation
from bench.serve import prefix as serve_prefix
from bench.serve.prefix import PrefixPlan


@dataclass(frozen=True)
class Plan:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    overhead_history_tokens: int  # history before the measured turn of the overhead probe
    overhead_samples: int
    request_timeout_s: float
    mode_budget_s: float  # wall-time budget of one mode's workload; turns not done by then are cut off
    prefix: PrefixPlan = serve_prefix.FULL
    restart_dead_vllm: bool = True  # start a vLLM server again for the next workload if its engine died
    seed: int = 0
    preset: str = "bench"


# The built-in tokenizer is one token per character, so lengths below are token counts.
FULL = Plan(conversations=2, turns=12, system_tokens=800, user_tokens=(80, 100), reply_tokens=(48, 52),
            overhead_history_tokens=500, overhead_samples=7, request_timeout_s=600, mode_budget_s=1200)


QUICK = Plan(conversations=2, turns=4, system_tokens=300, user_tokens=(60, 80), reply_tokens=(8, 12),
             overhead_history_tokens=500, overhead_samples=3, request_timeout_s=300, mode_budget_s=600,
             prefix=serve_prefix.QUICK)


# Proves the benchmark runs (CI, tests/bench): the tiny checkpoint, one short conversation; measures nothing.
SMOKE = Plan(conversations=1, turns=2, system_tokens=60, user_tokens=(10, 16), reply_tokens=(2, 3),
             overhead_history_tokens=200, overhead_samples=1, request_timeout_s=300, mode_budget_s=600,
             prefix=serve_prefix.SMOKE, restart_dead_vllm=False, preset="tiny")


MODES = {
    "a": "(a) our app, conversation cache on",
    "b": "(b) our app, no reuse (stateless, full history, a cache_salt per request)",
    "c": "(c) vLLM server, defaults (prefix caching on)",
    "d": "(d) vLLM server, --no-enable-prefix-caching",
}


def make_scripts(plan: Plan) -> list[Script]:
    rng = random.Random(plan.seed)
    scripts = []
    for c in range(plan.conversations):
        system, users, replies = scripted_conversation(rng, c, plan.turns, plan.system_tokens, plan.user_tokens,
                                                       plan.reply_tokens)
        scripts.append(Script(system, tuple(users), tuple(replies)))
    return scripts


def overhead_script(plan: Plan, index: int) -> Script:
    """Turn 1 builds a ~overhead_history_tokens history; turn 2 is the one measured."""
    rng = random.Random(1000 + index)
    system = chat_text(rng, plan.overhead_history_tokens - 120, f"Overhead probe {index}.")
    return Script(system, (chat_text(rng, 60, "Question 1:"), chat_text(rng, 60, "Question 2:")), (40, 16))
