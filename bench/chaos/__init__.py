"""Chaos run: `python -m bench.chaos [--quick] [--seed S]`.

The property of `bench/chaos/driver.py` (what every client was told is what the ledger holds;
outputs equal a fault-free replay) over a longer run than the test's: 16 conversations x 13
turns with client disconnects, duplicate retries, worker SIGKILLs, cache-service restarts and
Redis pauses longer than the cache client's deadline, on a stack of its own:

    EmbeddedRedis (AOF) <── python -m cache_service <── Ray Serve app (2 workers, tier async)
                 ^ SIGSTOP/SIGCONT        ^ SIGTERM + start       ^ ray.kill(replica)

Writes bench/results/chaos.{json,md} (the quick run: chaos.quick.*; --smoke, 2 x 2 turns and
one fault: chaos.smoke.*; --results-dir elsewhere). Not a speed benchmark:
the table is counts, and the run fails (exit 1) on any divergence.
"""
