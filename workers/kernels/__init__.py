"""The fast path's plumbing beside the model: the C++ kernels (`csrc/`, built by `extensions`),
the `FastPath` holder, the weight-matmul backends and their measured choice."""
