"""Structured logs: one JSON object per line on stderr.

Call sites log an event name as the message and the facts as `extra={"fields": {...}}`;
they never format values into the message, so logs stay machine-readable.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def fields(**values) -> dict:
    """`extra=` argument for a structured log call."""
    return {"fields": values}


def monotonic_ms() -> float:
    return time.perf_counter() * 1000.0
