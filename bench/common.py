"""Helpers shared by the benchmarks: environment facts, Markdown tables, writing results.

Every benchmark writes `bench/results/<name>.json` (all numbers, the method, the
environment) and `bench/results/<name>.md` (the human-readable tables).
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = RESULTS_DIR.parent.parent


def git_revision() -> dict:
    """The commit measured, and whether tracked files differed from it (others edit concurrently)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty_paths": git("status", "--porcelain", "-uno").splitlines()}


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def cpu_info() -> dict:
    """CPU model and the SIMD / matrix extensions that decide kernel speed (these machines vary)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"model": model, "simd_flags": [f for f in SIMD_FLAGS if f in flags]}


def environment_info() -> dict:
    """Facts that explain a number: interpreter, library versions, CPU, threads, load."""
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15m": list(os.getloadavg()),
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "git": git_revision(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_results(name: str, data: dict, markdown: str, results_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """Writes <results_dir>/<name>.json and <name>.md; returns both paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = results_dir / f"{name}.json", results_dir / f"{name}.md"
    _write_atomic(json_path, json.dumps(data, indent=2) + "\n")
    _write_atomic(md_path, markdown if markdown.endswith("\n") else markdown + "\n")
    return json_path, md_path


# Words of the synthetic chat text the conversation benchmarks send (plain ASCII, so the
# built-in tokenizer gives one token per character).
CHAT_WORDS = (
    "the model cache state turn reply token layer block prefix history user system please "
    "explain why how what when which small large fast slow exact aligned recurrent attention "
    "conversation request server replica memory compute again next first last value number "
    "list table order simple careful result check answer question detail example short long"
).split()


def chat_text(rng: random.Random, n_chars: int, lead: str = "") -> str:
    """About n_chars characters of words (the built-in tokenizer is one token per character)."""
    out = lead
    while len(out) < n_chars:
        out += (" " if out else "") + rng.choice(CHAT_WORDS)
    return out[:n_chars].rstrip() + "."
