"""What the grammar backends are measured on: grammars, features, probes, modes."""

from __future__ import annotations

from dataclasses import dataclass


MAX_TOKENS = 300


SWITCH_INTERVAL_S = 0.5  # the GIL check's, longer than any mask here (Python's default is 0.005)


SEED = 0


EOS = "<|endoftext|>"


GRAMMARS: dict[str, dict] = {
    "json_object": {"type": "object"},
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "role": {"enum": ["admin", "user", "guest"]},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "role", "active"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                "required": ["name", "vip"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["order_id", "customer", "items"],
        "additionalProperties": False,
    },
    "bounded": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 2, "maxLength": 8},
            "count": {"type": "integer", "minimum": 0, "maximum": 500},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["code", "count", "score", "tags"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city", "unit", "days"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}


WARM_UP = {"type": "array", "items": {"type": "boolean"}}  # compiled once per engine and tokenizer, first


# One feature each; bounded strings and numbers so that uniform sampling ends well within the cap.
_POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


_SEGMENT = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


FEATURES: dict[str, dict] = {
    "maxLength": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]},
    "minimum/maximum": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 17}}, "required": ["n"]},
    "enum": {"type": "object", "properties": {"c": {"enum": ["red", "green", 7, None]}}, "required": ["c"]},
    "$ref/$defs (nested)": {
        "type": "object",
        "$defs": {"point": _POINT, "segment": _SEGMENT},
        "properties": {"seg": {"$ref": "#/$defs/segment"}},
        "required": ["seg"],
        "additionalProperties": False,
    },
    "additionalProperties: false": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False
    },
    "required ordering": {
        "type": "object",
        "properties": {"z": {"type": "boolean"}, "a": {"type": "boolean"}, "m": {"type": "boolean"}},
        "required": ["z", "a", "m"],
        "additionalProperties": False,
    },
}  # fmt: skip


# Single characters after a prefix, on the character-level tokenizer: (schema, prefix, next,
# whether JSON allows it there).
PROBES: dict[str, tuple[dict, str, str, bool]] = {
    "raw tab in a plain string": ({"type": "string"}, '"', "\t", False),
    "raw tab in a string with maxLength": ({"type": "string", "maxLength": 6}, '"', "\t", False),
    "raw tab in a string with minLength": ({"type": "string", "minLength": 1}, '"', "\t", False),
    "escape in a string with maxLength": ({"type": "string", "maxLength": 6}, '"', "\\", True),
    "the \\/ escape": ({"type": "string"}, '"\\', "/", True),
    "leading zero of an integer": ({"type": "integer"}, "0", "1", False),
}


@dataclass(frozen=True)
class Mode:
    name: str
    tokenizers: tuple[int, ...]  # 0: the built-in character-level one, else a BPE vocabulary size
    grammars: tuple[str, ...]
    replays: int
    feature_samples: int
    gil_trials: int
    conversion_repeats: int
    compiles: int  # the compile time is the least of these many
    max_tokens: int = MAX_TOKENS


MODES = {
    "full": Mode("grammar_backends", (0, 32_000, 128_000), tuple(GRAMMARS), 10, 3, 100, 200, 5),
    "quick": Mode("grammar_backends.quick", (0, 32_000), tuple(GRAMMARS), 5, 3, 50, 100, 3),
    "smoke": Mode("grammar_backends.smoke", (0,), ("json_object", "flat"), 1, 1, 5, 3, 1, max_tokens=40),
}
