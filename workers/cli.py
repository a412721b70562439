"""`hybridserve` command line: make-model, train-builtin, generate, chat."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workers.errors import EngineError


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the built-in trained model)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="user message, rendered with the model's chat template")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, used as they are")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--logprobs", type=int, default=None, help="report the top K logprobs per token")
    parser.add_argument("--json", action="store_true", help="print token ids and logprobs as JSON")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="bit-identical output whatever else runs (decode, verify in fixed-shape tiles, roll back); "
        "without --seed the seed is derived from the prompt",
    )


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise EngineError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def run_generate(args: argparse.Namespace) -> None:
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        logprobs=args.logprobs,
        deterministic=args.deterministic,
    )
    from workers.checkpoint.builtin import default_model_dir

    engine = LLMEngine(EngineConfig(model=str(args.model or default_model_dir())))
    if args.prompt_ids is not None:
        prompt = _parse_ids(args.prompt_ids)
    else:
        text = engine.tokenizer.render_chat([{"role": "user", "content": args.prompt}])
        prompt = engine.tokenizer.encode(text)
    engine.add_request("cli", prompt, params)
    tokens, text, reason = [], "", None
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise EngineError(out.error)
            tokens.extend(out.new_tokens)
            text += out.text_delta
            reason = out.finish_reason
    if args.json:
        result = {
            "prompt_token_ids": prompt,
            "token_ids": [t.token_id for t in tokens],
            "logprobs": [t.logprob for t in tokens] if args.logprobs is not None else None,
            "top_logprobs": [[list(p) for p in t.top_logprobs] for t in tokens] if args.logprobs else None,
            "text": text,
            "finish_reason": reason.value if reason else None,
        }
        print(json.dumps(result))
    else:
        print(text)


def _run_make_model(args: argparse.Namespace) -> None:
    from workers.checkpoint.cli import run_make_model  # imports transformers: only when asked

    run_make_model(args)


def _add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--arch", choices=["bamba", "granitemoehybrid", "nemotron_h"], default="bamba")
    parser.add_argument("--preset", choices=["tiny", "small", "bench"], default="small")
    parser.add_argument(
        "--moe", action="store_true", help="mixture-of-experts variant (granitemoehybrid, nemotron_h; tiny, bench)"
    )
    parser.add_argument("--attention-head-dim", type=int, default=None,
                        help="fewer, wider attention heads (vLLM's CPU attention needs 32 or more; tiny has 16)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")


def _run_chat(args: argparse.Namespace) -> None:
    from workers import terminal_chat

    if terminal_chat.run(args):
        raise SystemExit(2)


def _run_train_builtin(args: argparse.Namespace) -> None:
    from workers.checkpoint.train_cli import run_train_builtin  # imports transformers: only when asked

    run_train_builtin(args)


def _add_train_builtin_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="directory to write the trained checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="same seed and threads, same weights")
    parser.add_argument("--epochs", type=int, default=None, help="passes over the training conversations")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per optimizer step")
    parser.add_argument("--max-sequence", type=int, default=None, help="longer conversations are cut")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (part of what fixes the bits)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-model", help="write a random-weight checkpoint with tokenizer and chat template")
    _add_make_model_arguments(make)
    make.set_defaults(run=_run_make_model)
    train = sub.add_parser("train-builtin", help="train the built-in model on chatterbot-corpus (CPU, minutes)")
    _add_train_builtin_arguments(train)
    train.set_defaults(run=_run_train_builtin)
    generate = sub.add_parser("generate", help="one-shot generation on a checkpoint")
    _add_generate_arguments(generate)
    generate.set_defaults(run=run_generate)
    from workers import terminal_chat  # its arguments only: the openai client is imported when it runs

    chat = sub.add_parser("chat", help="a terminal chat with a running server (streamed replies, a footer "
                                       "per turn: cached/prompt tokens, TTFT)")
    terminal_chat.add_arguments(chat)
    chat.set_defaults(run=_run_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
