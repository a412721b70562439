"""Virtualenvs of their own for the client libraries whose pins our environment cannot hold
(instructor 1.17 wants openai < 3.4, llama-index-llms-openai-like 0.8.1 wants 2.x, and we pin
3.51; lm-eval brings `datasets` and its evaluation stack, which our server has no use for): each is made once under `.venvs/` (ignored by git), like vLLM's (workers/vllm_backend/
venv.py), and its test drives the library there as a subprocess against the session's app.
The libraries that share our `openai` are in the `dev` extra instead.

    python -m tests.serve.clients.client_venvs     # make (or check) them all (.ci/run does)
"""

from __future__ import annotations

import subprocess
import sys
import venv
from enum import Enum
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


class ClientVenv(Enum):
    """A venv's name and the exact requirements installed in it."""

    INSTRUCTOR = ("clients-instructor", ("instructor==1.17.0", "openai==3.3.0", "pydantic==2.14.4"))
    LLAMA_INDEX = ("clients-llama-index", ("llama-index-llms-openai-like==0.8.1", "llama-index-core==0.14.25",
                                           "openai==2.54.0", "pydantic==2.14.4"))
    # local-completions needs the `api` extra (aiohttp, tenacity) and transformers for the
    # checkpoint's tokenizer; no torch: an API model tokenizes only, the server computes.
    LM_EVAL = ("clients-lm-eval", ("lm-eval[api]==0.4.13", "transformers==5.23.0", "tokenizers==0.23.3"))

    @property
    def directory(self) -> Path:
        return REPO_ROOT / ".venvs" / self.value[0]

    @property
    def python(self) -> Path:
        return self.directory / "bin" / "python"

    def ensure(self) -> Path:
        """The venv's interpreter, the venv made first if it is not there (or not these pins)."""
        ready = self.directory / ".ready"
        pins = "\n".join(self.value[1])
        if ready.exists() and ready.read_text() == pins and self.python.exists():
            return self.python
        print(f"hybridserve: installing {' '.join(self.value[1])} into {self.directory}", file=sys.stderr)
        venv.EnvBuilder(with_pip=True, clear=True).create(self.directory)
        subprocess.run([str(self.python), "-m", "pip", "install", "--quiet", *self.value[1]], check=True)
        subprocess.run([str(self.python), "-m", "pip", "check"], check=True)
        ready.write_text(pins)
        return self.python


if __name__ == "__main__":
    for client_venv in ClientVenv:
        print(client_venv.ensure())
