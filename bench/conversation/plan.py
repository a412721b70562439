"""The conversation benchmark's plans and scripted conversations."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.kit.chat_text import scripted_conversation


THREADS = 2


PROBES = 3  # extra TTFT samples per mode and turn (TTFT = min of PROBES + 1; median kept too)


VLLM_MAX_MODEL_LEN = 4096


RECHECK_HISTORY = 1600  # tokens: more than two of vLLM's hybrid blocks (640 on the bench models)


KERNEL_BLOCK = 16  # vLLM rounds the hybrid attention block size to a multiple of this


SALT = "bench"


@dataclass(frozen=True)
class Plan:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    hf_turns: tuple[int, ...]  # 1-based turns of conversation 0 measured with transformers
    seed: int = 0
    preset: str = "bench"


# Sized for ~10 minutes on 2 idle cores (decode of the replies, 4 modes, dominates).
FULL = Plan(conversations=1, turns=12, system_tokens=800, user_tokens=(80, 100), reply_tokens=(48, 52), hf_turns=(1, 6, 12))


QUICK = Plan(conversations=1, turns=3, system_tokens=300, user_tokens=(60, 80), reply_tokens=(8, 12), hf_turns=(3,))


# Proves the benchmark runs (CI, tests/bench): the tiny checkpoint, seconds; measures nothing.
SMOKE = Plan(conversations=1, turns=2, system_tokens=60, user_tokens=(10, 16), reply_tokens=(2, 3), hf_turns=(2,),
             preset="tiny")


# -- workload ---------------------------------------------------------------------------------
@dataclass
class Script:
    system: str
    users: list[str]
    replies: list[int]  # max_tokens per turn


def make_scripts(plan: Plan) -> list[Script]:
    rng = random.Random(plan.seed)
    scripts = []
    for c in range(plan.conversations):
        scripts.append(Script(*scripted_conversation(rng, c, plan.turns, plan.system_tokens, plan.user_tokens,
                                                     plan.reply_tokens)))
    return scripts


def suffix_of(script: Script, turn: int) -> list[dict]:
    user = {"role": "user", "content": script.users[turn]}
    return [{"role": "system", "content": script.system}, user] if turn == 0 else [user]
