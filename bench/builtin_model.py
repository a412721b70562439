"""How good the trained built-in model is, and whether its training reproduces: `python -m bench.builtin_model`.

    python -m bench.builtin_model [--model DIR] [--repro-steps 12] [--smoke] [--results-dir DIR]

On the checkpoint (default: the one shipped in the package), with the corpus split its
training.json names (same seed, same fraction):

* held-out loss: mean next-token cross-entropy (nats) over every token of the held-out
  conversations (transformers' forward), against a unigram model of the training tokens
  (add-one smoothing): the loss of a model that ignores context;
* greedy replies (our engine, max 64 tokens) to the first message of each held-out conversation
  (distinct prompts), counted as
    stops      the reply ends with <|end_of_turn|> (not cut by max_tokens)
    in corpus  it has a word and every word is a word of the training conversations
    sensible   stops and in corpus (the headline rate)
    an answer  it is, case and spacing aside, an answer of the corpus (any assistant line)
    on topic   it is one of the corpus's answers to that very prompt;
* reproducibility: `train-builtin` run twice with the same seed for `--repro-steps` steps, the
  weights' SHA-256 compared (and once with another seed, which must differ).

Writes bench/results/builtin_model.{json,md} (--smoke: 8 prompts and a 2-step training check
on short batches, builtin_model.smoke.*; --results-dir elsewhere).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from bench.kit.environment import environment_info
from bench.kit.results import RESULTS_DIR, write_results
from bench.kit.tables import format_number, markdown_table
from workers.checkpoint.builtin import default_model_dir
from workers.checkpoint.dialogue_corpus import load_conversations, split_conversations, vocabulary, words_of
from workers.checkpoint.train_builtin import TRAINING_FILE, TrainSettings, encode_all, mean_loss, train_builtin, unigram_loss
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.request import FinishReason
from workers.sampling import SamplingParams

MAX_TOKENS = 64
# What other commands measured (the full training command's reproduction, the serving benchmark
# on this model) is written below this line by hand; a new run of this benchmark keeps it.
KEPT_MARK = "<!-- Below: measured by other commands; kept when bench.builtin_model rewrites this file. -->"
SAMPLE_PROMPTS = ["Hello!", "How are you?", "What is your name?", "Tell me a joke.", "What do you like to eat?"]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _greedy(engine: LLMEngine, prompts: list[str]) -> dict[str, tuple[str, bool, int]]:
    """prompt -> (reply, stopped at end of turn, tokens), all requests batched in one engine."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for i, prompt in enumerate(prompts):
        text = engine.tokenizer.render_chat([{"role": "user", "content": prompt}])
        engine.add_request(str(i), engine.tokenizer.encode(text), params)
    replies, tokens, stopped = ["" for _ in prompts], [0 for _ in prompts], [False for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id)
            replies[i] += out.text_delta
            tokens[i] += len(out.new_token_ids)
            if out.finish_reason is not None:
                stopped[i] = out.finish_reason is FinishReason.STOP
    return {p: (replies[i], stopped[i], tokens[i]) for i, p in enumerate(prompts)}


def measure_replies(model_dir: Path, settings: TrainSettings, limit: int | None) -> dict:
    split = split_conversations(load_conversations(), settings.seed, settings.held_out_fraction)
    words = vocabulary(split.train)
    answers = {_norm(u) for c in split.train + split.held_out for u in c.utterances[1::2]}
    on_topic: dict[str, set[str]] = {}
    for c in split.train + split.held_out:
        on_topic.setdefault(_norm(c.prompt), set()).add(_norm(c.answer))
    prompts = list(dict.fromkeys(c.prompt for c in split.held_out))[:limit]
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    replies = _greedy(engine, prompts + [p for p in SAMPLE_PROMPTS if p not in prompts])
    rows = []
    for prompt in prompts:
        reply, stopped, n = replies[prompt]
        reply_words = words_of(reply)
        in_corpus = bool(reply_words) and set(reply_words) <= words
        rows.append({"prompt": prompt, "reply": reply, "tokens": n, "stops": stopped, "in_corpus": in_corpus,
                     "sensible": stopped and in_corpus, "an_answer": _norm(reply) in answers,
                     "on_topic": _norm(reply) in on_topic.get(_norm(prompt), set())})
    rate = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in ("stops", "in_corpus", "sensible", "an_answer", "on_topic")}
    samples = [{"prompt": p, "reply": replies[p][0], "stops": replies[p][1]} for p in SAMPLE_PROMPTS]
    return {"prompts": len(rows), "rates": rate, "samples": samples, "held_out": rows}


def measure_loss(model_dir: Path, settings: TrainSettings) -> dict:
    split = split_conversations(load_conversations(), settings.seed, settings.held_out_fraction)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train = encode_all(tokenizer, split.train, settings.max_sequence)
    held_out = encode_all(tokenizer, split.held_out, settings.max_sequence)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    return {"held_out_loss": round(mean_loss(model, held_out, settings.batch_tokens), 4),
            "unigram_held_out_loss": round(unigram_loss(train, held_out, tokenizer.get_vocab_size()), 4),
            "held_out_tokens": sum(len(s) - 1 for s in held_out)}


def _weights_sha(settings: TrainSettings, root: Path, name: str) -> str:
    out = train_builtin(root / name, settings, progress=False).out_dir
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def check_reproducible(settings: TrainSettings) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        first, second = _weights_sha(settings, root, "a"), _weights_sha(settings, root, "b")
        other = _weights_sha(TrainSettings(**{**settings.__dict__, "seed": settings.seed + 1}), root, "c")
    return {"steps": settings.max_steps, "seed": settings.seed, "threads": settings.threads,
            "sha256_first": first, "sha256_second": second, "identical": first == second,
            "other_seed_differs": other != first}


def markdown(data: dict) -> str:
    t, loss, rep, repro = data["training"], data["loss"], data["replies"], data["reproducibility"]
    corpus = t["corpus"]
    lines = [
        "# The trained built-in model", "",
        f"Checkpoint `{data['model']}`: {format_number(t['result']['parameters'])} parameters, trained "
        f"{t['result']['steps']} steps in {format_number(t['result']['train_seconds'])} s "
        f"({t['settings']['threads']} thread) on `{corpus['package']}` {corpus['version']} ({corpus['license']}), "
        f"{corpus['train_conversations']} conversations, {corpus['held_out_conversations']} held out by seed "
        f"{t['settings']['seed']}. CPU: {data['environment']['cpu']['model']}.", "",
        markdown_table(["held-out loss (nats/token)", "value"], [
            ["the model", format_number(loss["held_out_loss"], 3)],
            ["unigram baseline", format_number(loss["unigram_held_out_loss"], 3)],
            ["tokens scored", format_number(loss["held_out_tokens"])],
        ]), "",
        f"Greedy replies to the {rep['prompts']} distinct held-out prompts (max {MAX_TOKENS} tokens; "
        "*sensible* = stops at end of turn and every word is a word of the training conversations):", "",
        markdown_table(["measure", "rate"], [[k.replace("_", " "), format_number(v, 3)] for k, v in rep["rates"].items()]),
        "",
        markdown_table(["prompt", "greedy reply", "stops"],
                       [[s["prompt"], s["reply"].replace("|", "\\|").replace("\n", " "), str(s["stops"])] for s in rep["samples"]],
                       align="llc"),
        "",
        f"{len({r['reply'] for r in rep['held_out']})} distinct replies to {rep['prompts']} prompts: the model "
        "answers in corpus lines and stops, but conditions weakly on the prompt (*on topic* is the rate "
        "that says so; *sensible* and *an answer* only say the reply is well-formed corpus English).", "",
        f"Reproducibility: two runs of {repro['steps']} steps a stage with seed {repro['seed']} "
        f"({repro['threads']} thread): weights {'bit-identical' if repro['identical'] else 'DIFFERENT'} "
        f"(sha256 {repro['sha256_first'][:16]}…); another seed gives "
        f"{'other' if repro['other_seed_differs'] else 'THE SAME'} weights.",
    ]
    return "\n".join(lines) + "\n"


def kept_part(md_path: Path) -> str:
    text = md_path.read_text() if md_path.is_file() else ""
    return "\n" + text[text.index(KEPT_MARK):] if KEPT_MARK in text else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the shipped built-in one)")
    parser.add_argument("--repro-steps", type=int, default=12)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = args.model or default_model_dir()
    training = json.loads((model_dir / TRAINING_FILE).read_text())
    settings = TrainSettings(**training["settings"])
    repro = (TrainSettings(seed=settings.seed, max_steps=2, batch_tokens=256, max_sequence=64) if args.smoke
             else TrainSettings(**{**training["settings"], "max_steps": args.repro_steps}))
    data = {
        "model": str(model_dir.name), "training": training,
        "loss": measure_loss(model_dir, settings),
        "replies": measure_replies(model_dir, settings, 8 if args.smoke else None),
        "reproducibility": check_reproducible(repro),
        "environment": environment_info(),
    }
    stem = "builtin_model.smoke" if args.smoke else "builtin_model"
    kept = kept_part(args.results_dir / f"{stem}.md")
    json_path, md_path = write_results(stem, data, markdown(data) + kept, args.results_dir)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
