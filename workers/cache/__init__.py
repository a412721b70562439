"""Cache accounting (block pool, state slots) and the tensors they describe."""
