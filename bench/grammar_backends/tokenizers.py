"""The tokenizers measured: the built-in one and byte-level BPE trained here."""

from __future__ import annotations

import sysconfig
import time
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from bench.grammar_backends.engines import TokenizerCase
from bench.grammar_backends.plan import EOS
from workers.checkpoint.tokenizer import build_tokenizer


def stdlib_text(max_bytes: int) -> list[str]:
    """The standard library's .py sources in sorted order, up to max_bytes (deterministic)."""
    root, texts, size = Path(sysconfig.get_paths()["stdlib"]), [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text.encode())
        if size >= max_bytes:
            break
    return texts


def train_bpe(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of about vocab_size ids, trained on local text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    # More ids need more distinct text: 4 MB for 32k; for 128k all of the standard library (about
    # 31 MB, which gives some 123k ids).
    tokenizer.train_from_iterator(stdlib_text(vocab_size**2 // 256), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, clean_up_tokenization_spaces=False)


def tokenizer_case(vocab: int) -> TokenizerCase:
    if vocab == 0:
        return TokenizerCase.of("char-104", build_tokenizer(), byte_level=False)
    started = time.perf_counter()
    case = TokenizerCase.of(f"bpe-{vocab // 1000}k", train_bpe(vocab), byte_level=True)
    print(f"trained {case.name} ({case.vocab_size} ids) in {time.perf_counter() - started:.1f} s", flush=True)
    return case
