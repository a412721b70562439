"""The English dialogue corpus the built-in model is trained on: `chatterbot-corpus`'s YAML files.

Each file is one topic (greetings, food, ...) holding a list of conversations; a conversation is
a list of utterances that alternate user / assistant, starting with the user:

    conversations:
    - - Hello                  -> user
      - Hi                     -> assistant
    - - How are you doing?
      - I am doing well.

The package is needed only to train (`hybridserve train-builtin`, the `train` extra); the
trained checkpoint records which version it saw.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

CORPUS_PACKAGE = "chatterbot-corpus"
# Declared by the package (its PyPI classifier "License :: OSI Approved :: BSD License";
# the repository's LICENSE is BSD-3-Clause).
CORPUS_LICENSE = "BSD-3-Clause"
LANGUAGE = "english"


@dataclass(frozen=True)
class Conversation:
    topic: str
    utterances: tuple[str, ...]  # user, assistant, user, ...

    def messages(self) -> list[dict[str, str]]:
        roles = ("user", "assistant")
        return [{"role": roles[i % 2], "content": text} for i, text in enumerate(self.utterances)]

    @property
    def prompt(self) -> str:
        return self.utterances[0]

    @property
    def answer(self) -> str:
        return self.utterances[1]


@dataclass(frozen=True)
class CorpusSplit:
    train: tuple[Conversation, ...]
    held_out: tuple[Conversation, ...]


def corpus_version() -> str:
    return metadata.version(CORPUS_PACKAGE)


def _data_dir() -> Path:
    try:
        import chatterbot_corpus
    except ImportError as e:
        raise RuntimeError(
            f"training the built-in model needs the {CORPUS_PACKAGE} package: pip install -e '.[train]'"
        ) from e
    return Path(chatterbot_corpus.__file__).parent / "data" / LANGUAGE


def _text(value: object) -> str | None:
    # A few answers are YAML numbers or booleans ("- - What is 2 + 2? - 4"); keep them as text.
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        text = " ".join(str(value).split())
        return text or None
    return None


def load_conversations(data_dir: Path | None = None) -> list[Conversation]:
    """Every conversation with at least a prompt and an answer, in file then file order."""
    out = []
    for path in sorted((data_dir or _data_dir()).glob("*.yml")):
        body = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for raw in body.get("conversations") or []:
            utterances = tuple(t for t in map(_text, raw or []) if t)
            if len(utterances) >= 2:
                out.append(Conversation(path.stem, utterances))
    return out


def split_conversations(conversations: list[Conversation], seed: int, held_out_fraction: float) -> CorpusSplit:
    """A seeded random split of whole conversations (a held-out prompt may still occur in
    training with another answer: the corpus repeats greetings on purpose)."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    n_held = round(len(order) * held_out_fraction)
    held = sorted(order[:n_held])
    train = sorted(order[n_held:])
    return CorpusSplit(tuple(conversations[i] for i in train), tuple(conversations[i] for i in held))


_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


def words_of(text: str) -> list[str]:
    """Lower-cased words (letters and inner apostrophes); digits and punctuation are not words."""
    return _WORD.findall(text.lower())


def vocabulary(conversations: tuple[Conversation, ...] | list[Conversation]) -> frozenset[str]:
    """Every word the conversations use."""
    return frozenset(w for c in conversations for u in c.utterances for w in words_of(u))
