"""From the measured points to a fleet: what 1,000 GPU replicas need, and what ran out first.

    demand        = 1,000 x GPU turn rate (cost_model.GPU_TURNS_PER_S, gpu.md's c=32 row)
    instances     = demand / turns per instance-core-second      (best point; one core each)
    Redis shards  = demand x commands per turn / commands per Redis-core-second   (single thread)
    router cores  = demand x routing seconds per turn at the point with the most replicas

Normalizing by CPU seconds (/proc, Redis INFO cpu) takes the shared two-core machine out of the
capacity figures: each of those processes is bound by one core in production.
"""

from __future__ import annotations

import math

from bench.scale.cost_model import BATCH, GPU_TURNS_PER_S
from bench.scale.mix import mix_turns_per_s

FLEET = 1000
# Achieved below this share of the offered rate: saturated. Not 1: sticky routing queues turns on
# their owners while other replicas idle, and each turn adds its cache calls to the model time.
SATURATED = 0.6


def offered_turns_per_s(replicas: int, sessions: int) -> float:
    """What the replicas would complete with their slots full, bounded by the sessions driving them."""
    return mix_turns_per_s() * min(replicas, sessions / BATCH)


def instance_cores(point: dict) -> float:
    return sum(v for k, v in point["cpu_cores"].items() if k.startswith("instance"))


def bottleneck(point: dict) -> str:
    """The process with the largest share of a core (each is single-threaded at heart)."""
    per_process = dict(point["cpu_cores"])
    return max(per_process, key=per_process.get)


def size(points: list[dict]) -> dict:
    demand = FLEET * GPU_TURNS_PER_S
    measured = [p for p in points if p["turns"] > 0] or points  # a point that completed no turn has no per-turn figure
    per_instance_core = max(p["turns_per_s"] / instance_cores(p) for p in measured if instance_cores(p) > 0)
    redis_commands_per_core = max(p["redis"]["commands"] / p["seconds"] / p["cpu_cores"]["redis"]
                                  for p in measured if p["cpu_cores"]["redis"] > 0)
    commands_per_turn = max(p["redis"]["commands_per_turn"] for p in measured)
    widest = max(points, key=lambda p: p["point"]["replicas"])
    route_s = widest["route"]["mean_ms"] / 1000
    saturated = [p for p in points if p["turns_per_s"] < SATURATED * p["offered_turns_per_s"]]
    first = min(saturated, key=lambda p: (p["point"]["replicas"], p["point"]["instances"]), default=None)
    return {
        "fleet_replicas": FLEET, "gpu_turns_per_s_per_replica": GPU_TURNS_PER_S,
        "mix_turns_per_s_per_replica": mix_turns_per_s(), "demand_turns_per_s": demand,
        "turns_per_instance_core_s": per_instance_core, "instances_needed": math.ceil(demand / per_instance_core),
        "redis_commands_per_core_s": redis_commands_per_core, "redis_commands_per_turn": commands_per_turn,
        "redis_shards_needed": math.ceil(demand * commands_per_turn / redis_commands_per_core),
        "route_ms_at_widest": 1000 * route_s, "widest_replicas": widest["point"]["replicas"],
        "router_cores_needed": demand * route_s,
        "first_saturated_point": first["point"] if first else None,
        "first_saturated_by": bottleneck(first) if first else None,
        "first_saturated_cpu_cores": first["cpu_cores"] if first else None,
    }
