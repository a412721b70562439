"""Order statistics the benchmarks report.

Three definitions are in use, each kept by the benchmarks that have always reported it (so
their figures stay comparable with their earlier results).
"""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100), interpolated linearly between neighbours; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def nearest_rank(values: list[float], q: float) -> float:
    """The sample at rank floor(q * n) (q in 0..1), the last one at most."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rounded_rank(values: list[float], q: float) -> float | None:
    """The sample at rank round(q * (n - 1)) (q in 0..1); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
