"""bench.builtin_model rewrites its markdown from its own measurements; what other commands
measured on the model (the full training command's reproduction, the serving benchmark) is
kept below KEPT_MARK."""

from __future__ import annotations

from bench.builtin_model import KEPT_MARK, kept_part


def test_the_part_below_the_mark_is_kept(tmp_path):
    md = tmp_path / "builtin_model.md"
    md.write_text(f"# Old tables\n\n| a | 1 |\n\n{KEPT_MARK}\n\n## Full run\n\nsha256 0d78…\n")
    assert kept_part(md) == f"\n{KEPT_MARK}\n\n## Full run\n\nsha256 0d78…\n"


def test_nothing_is_kept_without_the_mark_or_the_file(tmp_path):
    md = tmp_path / "builtin_model.md"
    assert kept_part(md) == ""
    md.write_text("# Old tables\n")
    assert kept_part(md) == ""
