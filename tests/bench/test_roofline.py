"""bench.kit.roofline: a fp32 rate measured elsewhere in the benchmark counts as a peak probe."""

import pytest
from torch import nn

from bench.kit.roofline import forward_key, roofline


def test_a_faster_reading_taken_during_the_runs_raises_the_peak_and_every_compute_ceiling():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    plain = roofline(model, [(4096, 1)], state_bytes_per_sequence=0)
    probed = plain["machine"]["peak_gflops"]
    faster = 10 * probed
    roof = roofline(model, [(4096, 1)], state_bytes_per_sequence=0, peak_readings={"host_speed_best_of_runs": faster})
    machine = roof["machine"]
    assert machine["peak_probes_gflops"]["host_speed_best_of_runs"] == faster
    assert machine["peak_gflops"] == faster
    # 4,096 rows through a 0.5 MB model is compute-bound: its ceiling follows the peak.
    entry = roof[forward_key(4096, 1)]
    assert entry["bound"] == "compute"
    assert entry["tokens_per_s"] == pytest.approx(faster * 1e9 / (2 * 2 * 256 * 256))
