"""What the benchmarks share: results, environment facts, tables and statistics, the servers
they start and the clients that drive them, the vLLM peer, checkpoints, the roofline."""
