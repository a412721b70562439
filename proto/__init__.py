"""The wire contract of the cache service (cache.proto) and its generated modules.

Regenerate after editing cache.proto with `python -m proto.generate`; a test checks
that the checked-in modules match a fresh generation byte for byte.
"""
