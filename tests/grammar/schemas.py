"""Seeded random JSON schemas for the constrained-decoding tests: objects, arrays, enums,
nesting. Every schema bounds its output (string lengths, integer ranges, array sizes), so a
reply that follows the grammar always ends within the tests' token budget."""

from __future__ import annotations

import random
import string


def random_schema(seed: int, depth: int = 0) -> dict:
    rng = random.Random(seed)
    return _object(rng, depth)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(list(string.ascii_lowercase), rng.randint(1, 4))
    properties = {name: _value(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.8]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "null"] + (["array", "object"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "x y", "ok"], rng.randint(1, 4))}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return _object(rng, depth)
