"""Chaos run: `python -m bench.chaos [--quick|--smoke] [--seed S]`.

The property of `bench/chaos/driver.py` (what every client was told is what the service holds;
a replay by Idempotency-Key equals the live answer; outputs equal a fault-free replay) over a
longer run than the test's: 24 clients x 17 turns — explicit chat conversations, Responses API
chains that fork and DELETE, stateless full-history clients — with client disconnects,
duplicate retries, conversations idle past a short TTL, worker SIGKILLs, cache-service
restarts and stalls, Redis pauses longer than the cache client's deadline, and a state tier
small enough to spill all along, on a stack of its own:

    EmbeddedRedis (AOF) <── python -m cache_service <── Ray Serve app (2 workers, tier async)
                 ^ SIGSTOP/SIGCONT        ^ SIGTERM + start,      ^ ray.kill(replica)
                                            SIGSTOP/SIGCONT, tier budget 256 KiB, TTL 20 s

Writes bench/results/chaos.{json,md} (the quick run: chaos.quick.*; --smoke, 3 x 2 turns and
one fault: chaos.smoke.*; --results-dir elsewhere). Not a speed benchmark:
the table is counts, and the run fails (exit 1) on any divergence.
"""
