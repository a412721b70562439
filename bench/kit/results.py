"""Where benchmarks write: `bench/results/<name>.json` (all numbers, the method, the
environment) and `<name>.md` (the human-readable tables), and the commit measured.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


REPO_ROOT = RESULTS_DIR.parent.parent


def git_revision() -> dict:
    """The commit measured, and whether tracked files differed from it (others edit concurrently)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty_paths": git("status", "--porcelain", "-uno").splitlines()}


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
