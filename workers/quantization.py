"""The engine's weight quantization choice, importable without torch (the ingress validates it)."""

from __future__ import annotations

from enum import Enum


class WeightQuantization(str, Enum):
    """How the fast path stores the blocks' linear weights (`workers.model.linear_tuning`).

    NONE  the weights as loaded (the reference and the default)
    INT8  weight-only int8, one fp32 scale per output channel, multiplied in fp32 by the panel
          kernel: a quarter of the weight bytes per decode step, at a measured accuracy cost
          (`bench.engine` reports it in its own rows). Batches beyond 64 rows (prompt chunks)
          run on the fp32 weights (`linear_tuning.int8_plan`). The reference path, the
          deterministic verifier and the LM head keep the fp32 weights, which stay loaded.
    """

    NONE = "none"
    INT8 = "int8"
