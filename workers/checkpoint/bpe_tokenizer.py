"""A byte-level BPE tokenizer trained here (`tokenizers`), for the trained built-in model.

Ids 0..6 are the special tokens of `tokens.SpecialToken` in their enum order, so <|pad|>,
<|bos|> and <|end_of_turn|> (the EOS) keep the ids 0, 1 and 2 of the character-level
tokenizer; then the 256 byte symbols, then the merges. Byte-level means every text encodes
(no <|unk|> ever) and decodes back exactly; the chat template is the same as the random
checkpoints' (`chat_template.py`), so tool rendering and parsing work unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from workers.checkpoint.tokenizer import build_tokenizer
from workers.checkpoint.tokens import EOS_TOKEN_ID, SpecialToken


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE of `vocab_size` tokens (specials included) over `texts`; deterministic:
    the trainer breaks ties between equally frequent pairs by their symbols."""
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: " Hi" and "Hi" stay different, so text round-trips exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [AddedToken(t.value, special=True, normalized=False, lstrip=False, rstrip=False) for t in SpecialToken]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    assert tokenizer.token_to_id(SpecialToken.END_OF_TURN.value) == EOS_TOKEN_ID
    return tokenizer


def never_sample_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Every special token but the EOS: the engine never samples them."""
    ids = (tokenizer.token_to_id(t.value) for t in SpecialToken if t is not SpecialToken.END_OF_TURN)
    return tuple(sorted(ids))


def wrap_bpe(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer (special roles, chat template) around a trained BPE."""
    return build_tokenizer(tokenizer)
