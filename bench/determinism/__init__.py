"""Deterministic-mode benchmark: `python -m bench.determinism [--quick]`.

On the `bench` checkpoint under a steady mixed load (a closed loop keeps `concurrency`
requests in flight until `requests` have finished; prompt and reply lengths vary), a
fraction of the requests is deterministic (decode on the fast path, verify in G x W tiles,
roll back). Measured:

    throughput (output tokens/s) relative to the all-ordinary run, at 0, 2, 10, 50, 100 %
    baselines, where every request is deterministic by other means:
      (a) fixed-shape path for everything: every token of every request from a tile pass
          (DeterministicConfig(fast_decode=False)); no dynamic batching of any kernel
      (b) no dynamic batching: one request at a time (max_num_seqs = 1)
    rollback % (candidates thrown away / deterministic tokens) and throughput at W = 16..128
    rows per pass G = 4, 8, 16 at the chosen W
    p50 / p99 latency of deterministic requests (submit -> last token), and of ordinary ones

The baselines are slow, so they run for a fixed time budget and count the tokens produced
in it (tokens/s over the window; each still starts with its prefills).

Writes bench/results/determinism.{json,md,png} (a quick run: determinism.quick.*; --smoke, the
tiny checkpoint in seconds: determinism.smoke.*; --results-dir elsewhere).
"""
