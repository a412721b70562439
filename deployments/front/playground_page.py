"""The playground: a chat page served at `/` (its files in playground/: plain HTML, CSS and
JavaScript, no build step, nothing fetched from elsewhere). The page talks to the app's own
/v1 API with relative URLs; its <base> names the app's route prefix so that they resolve
whether it is opened as `/prefix` or `/prefix/`."""

from __future__ import annotations

import html
from functools import cache
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

FILES = Path(__file__).parent / "playground"


@cache
def _index() -> str:
    return (FILES / "index.html").read_text()


def index(root_path: str) -> str:
    """index.html with a <base> at the app's root (Serve's route prefix, "" at /)."""
    base = f'<base href="{html.escape(root_path.rstrip("/"))}/">'
    return _index().replace("<head>", f"<head>\n  {base}", 1)


def install(api: FastAPI) -> None:
    """The page's scripts and styles under /playground/ (the page itself is the ingress's `/`)."""
    api.mount("/playground", StaticFiles(directory=FILES), name="playground")
