"""Deterministic requests: decode on the fast path, verify in fixed-shape tiles, roll back.

See ARCHITECTURE.md ("Deterministic mode").
"""
