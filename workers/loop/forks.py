"""n > 1: n replies of one request from one prefill.

Choice 0 is the request itself: it is admitted, prefills its prompt and keeps state as any
request does (a conversation's prepared turn, a checkpoint). Choices 1..n-1 wait in its `forks`
until the step that runs the end of its prompt; that step samples every choice from the same
logits row (each with its own seed), then forks them from its state:

    choice 0 blocks:  [ b3 | b5 | b8: t8 t9 . . ]   prompt of 10 tokens, block size 4
    choice 1 blocks:  [ b3 | b5 | b9: t8 t9 . . ]   b3, b5 shared; b8 -> b9 copied (tail COW)
    choice 1 slot:    s7 <- copy of choice 0's terminal Mamba state

From there each choice decodes as a request of its own (its own stop checks, grammar, finish).
A choice that finds no room for its tail block and slot waits in the queue and computes its
prompt itself, as a preempted request does: the same tokens, only not shared. A fork is not
held back by max_num_seqs (a group is admitted as one request): the running set may exceed it
by n - 1 per group; the slots and blocks a fork takes are counted as any request's.
"""

from __future__ import annotations

import dataclasses

from workers.request import Request
from workers.sampling import SamplingParams

_SEEDS = 2**63


def choice_id(request_id: str, choice: int) -> str:
    return request_id if choice == 0 else f"{request_id}#{choice}"


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice i samples with seed + i (mod 2**63): choice i of a seeded request draws what a
    single request with that seed draws. Unseeded, each choice gets its own random seed."""
    if choice == 0:
        return params
    seed = None if params.seed is None else (params.seed + choice) % _SEEDS
    return dataclasses.replace(params, seed=seed)

