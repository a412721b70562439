"""Scale simulation: `python -m bench.scale [--quick | --smoke] [--max-points N]`.

The router's own code (StickyConversationRouter.choose_replicas), real cache-service instances
(`python -m cache_service`, 1 and 2 processes on one embedded Redis) and real Redis, with
simulated GPU replicas: no model, each replica "computes" a turn by sleeping per a cost model
fitted to our measured H200 speeds (cost_model.py), and does the cache-service cycle a worker
does per turn (replica.py). Sweeps replicas and stored conversations (drive.py), and reports
turns/s per instance, Redis commands and bytes per turn, call latencies, tier bandwidth and what
1,000 GPU replicas need (sizing.py, report.py). Everything client-side runs in one asyncio
process: on a 2-core machine the replica count is simulated, not processes.

Writes bench/results/scale.{json,md,png} (--quick: scale.quick.*, --smoke: the quick plan's first
point, scale.smoke.*).
"""
