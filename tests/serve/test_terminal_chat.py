"""`hybridserve chat` against the real app: a subprocess fed lines on stdin, as a user types them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)
FOOTER = re.compile(r"\[turn (\d+) · cached (\d+)/(\d+) prompt tokens(?: \(([a-z ]+)\))? · TTFT (\d+) ms"
                    r"(?: · replica \w+)?\]")


def run_chat(base_url: str, *args: str, lines: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "workers.cli", "chat", "--base-url", base_url, "--max-tokens", "8", *args]
    return subprocess.run(command, input="".join(f"{line}\n" for line in lines), capture_output=True, text=True,
                          timeout=90, env={**os.environ, "PYTHONPATH": os.getcwd()})


def chat(base_url: str, *args: str, lines: list[str]) -> str:
    done = run_chat(base_url, *args, lines=lines)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("mode, source", [([], "conversation head"), (["--stateless"], "prefix")])
def test_each_turn_streams_and_ends_with_a_footer_that_shows_the_reuse(stack, mode, source):
    out = chat(stack.base_url, *mode, lines=["Hello!", "", "How are you?"])
    footers = FOOTER.findall(out)
    assert len(footers) == 2, out
    (turn_1, cached_1, prompt_1, _, _), (turn_2, cached_2, prompt_2, source_2, _) = footers
    assert int(cached_1) == 0 and int(prompt_1) > 0
    assert 0 < int(cached_2) < int(prompt_2) and source_2 == source, out
    if not mode:  # the conversation's turns as the server committed them
        assert (turn_1, turn_2) == ("1", "2")
    assert out.count("you> ") == 4  # a prompt per line read, and one at the end of input


def test_the_servers_error_message_is_shown_and_the_chat_goes_on(stack, notier):
    out = chat(stack.base_url + notier, "--api-key", "k1", "--model", "nope", lines=["Hello!", "again"])
    assert out.count("error: model 'nope' does not exist") == 2, out
    denied = run_chat(stack.base_url + notier, "--api-key", "wrong", lines=[])
    assert denied.returncode == 2 and "error: invalid or missing API key" in denied.stderr
