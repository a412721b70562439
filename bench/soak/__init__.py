"""Retention soak: `python -m bench.soak [--smoke]`: Redis memory stays bounded under stored traffic.

What grew without bound before conversations expired: every `POST /v1/responses` without
`previous_response_id` (`store` defaults to true: the Agents SDK's way, and many frameworks')
stores a conversation, and every short chat leaves its head, ledger, marks and fence. The soak
drives the real app with both — 5,000 stateless Responses calls and 2,000 two-turn
conversations, tiny replies so it is about storage, not compute — on a stack whose
conversation TTL is shortened to 20 s, while a few "live" conversations take a turn every
TTL / 4 all along:

    EmbeddedRedis <── python -m cache_service (TTL 20 s) <── Ray Serve app (2 workers) <── clients
         ^ INFO memory + DBSIZE sampled every 0.5 s

It states a bound derived from the run (the bytes one stored conversation takes, times the most
conversations used within one TTL window, plus the baseline) and checks that Redis `used_memory`
and the key count stay under it, that both come back down once the TTL has passed after the
load, and that nothing of a live conversation was lost (every turn continued its ledger).
Writes bench/results/soak.{json,md,png} (--smoke: a few dozen calls, TTL 3 s, soak.smoke.*).
Exits 1 if a check fails.
"""
