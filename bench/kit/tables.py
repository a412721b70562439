"""Markdown tables and the number formats the reports share."""

from __future__ import annotations

from collections.abc import Sequence


def format_number(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A GitHub Markdown table; `align` is one of l/r/c per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers) or any(len(r) != len(headers) for r in rows):
        raise ValueError("every row and the alignment need one entry per header")
    rule = {"l": ":--", "r": "--:", "c": ":-:"}
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join(rule[a] for a in align) + " |",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def ms(seconds: float | None, fine_below_s: float | None = None) -> str:
    """Seconds as thousands-separated whole milliseconds, "—" when missing; below fine_below_s with
    one decimal instead."""
    if seconds is None:
        return "—"
    if fine_below_s is not None and seconds < fine_below_s:
        return f"{seconds * 1e3:.1f}"
    return f"{seconds * 1e3:,.0f}"


def percent(fraction: float | None, digits: int = 0) -> str:
    return "—" if fraction is None else f"{fraction:.{digits}%}"
