"""The load: multi-turn chats and agent loops over a population of stored conversations.

    chat session  (70 %)  one turn of a conversation, then the user reads and types: the next
                          turn of that conversation comes much later, from another session
                          new prompt 30..400 tokens, reply 80..500 tokens (3 %: a long answer of
                          1,500 tokens, ~40 s: its lease is renewed while it runs)
                          -> the head is exported to the tier after the turn (the conversation
                             goes quiet for longer than the app's tier_export_delay_s)
    agent loop    (30 %)  3..12 turns of one conversation back to back: each a tool result in
                          (150..2,000 tokens) and a tool call out (20..150 tokens)
                          -> exported once, after its last step (quiet only then)

Conversations are drawn uniformly from the population (every one of them stored, with one
seeded turn, before the point starts), so most turns continue a conversation that a replica
may or may not hold.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.scale.cost_model import BATCH, TurnWork

CHAT_SHARE = 0.7
LONG_ANSWER_SHARE = 0.03
LONG_ANSWER_TOKENS = 1500


@dataclass(frozen=True)
class Step:
    work: TurnWork
    export: bool  # the head goes to the state tier after this turn


def chat(rng: random.Random) -> list[Step]:
    output = LONG_ANSWER_TOKENS if rng.random() < LONG_ANSWER_SHARE else rng.randint(80, 500)
    return [Step(TurnWork(rng.randint(30, 400), output), export=True)]


def agent_loop(rng: random.Random) -> list[Step]:
    steps = rng.randint(3, 12)
    return [Step(TurnWork(rng.randint(150, 2000), rng.randint(20, 150)), export=i == steps - 1)
            for i in range(steps)]


def session(rng: random.Random) -> list[Step]:
    """The turns one session runs on one conversation."""
    return chat(rng) if rng.random() < CHAT_SHARE else agent_loop(rng)


def mix_turns_per_s(samples: int = 20_000, seed: int = 0) -> float:
    """Turns per second one fully busy replica completes on this mix (BATCH slots)."""
    rng = random.Random(seed)
    steps = [s for _ in range(samples) for s in session(rng)]
    mean_s = sum(s.work.seconds() for s in steps) / len(steps)
    return BATCH / mean_s
