"""Grammar engines for constrained decoding (JSON schema, json_object, forced tool calls):
llguidance vs xgrammar, on our tokenizers.

    python -m bench.grammar_backends [--quick | --smoke] [--results-dir DIR]

Tokenizers: the built-in character-level one (104 ids) and byte-level BPE tokenizers trained here
on the Python standard library's sources (32k ids; 128k in the full run). No model hub is needed.
Grammars: json_object and four JSON schemas, separators ", " and ": ", no free whitespace.

Per (engine, tokenizer, grammar):
  tokenizer info   one-off: the engine's view of the vocabulary
  compile          cold: schema -> a matcher ready for its first mask
  per token        compute the next-token bitmask + consume the sampled token, over a sequence
                   sampled by a seeded uniform choice among the allowed ids (same seed for both
                   engines, at most MAX_TOKENS tokens); the sequence is replayed, per step the
                   least of the replays; mean, median and p99 microseconds over the steps
  agreement        the first engine's sequence walked through both: where the allowed sets differ
Once per engine: whether the mask computation releases the GIL (a pure-Python loop's iterations
beside a thread computing masks, over alone), which schema features compile and are honoured
(samples decoded, parsed, validated with `jsonschema`), single-character probes of JSON's string
and number rules, and what turning a mask into a boolean torch tensor of vocabulary size costs.
Writes bench/results/grammar_backends[.quick|.smoke].{json,md} (--results-dir elsewhere). An
engine that is not installed is recorded as such and left out.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import random
import statistics
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import torch
from transformers import PreTrainedTokenizerFast

from bench.common import RESULTS_DIR, environment_info, format_number, markdown_table, write_results
from bench.grammar_engines import ENGINES, Engine, GrammarError, Matcher, TokenizerCase, allowed_ids, allowed_mask
from bench.grammar_engines import new_bitmask
from workers.checkpoint.tokenizer import build_tokenizer

MAX_TOKENS = 300
SWITCH_INTERVAL_S = 0.5  # the GIL check's, longer than any mask here (Python's default is 0.005)
SEED = 0
EOS = "<|endoftext|>"

GRAMMARS: dict[str, dict] = {
    "json_object": {"type": "object"},
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "role": {"enum": ["admin", "user", "guest"]},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "role", "active"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                "required": ["name", "vip"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["order_id", "customer", "items"],
        "additionalProperties": False,
    },
    "bounded": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 2, "maxLength": 8},
            "count": {"type": "integer", "minimum": 0, "maximum": 500},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["code", "count", "score", "tags"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city", "unit", "days"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}

WARM_UP = {"type": "array", "items": {"type": "boolean"}}  # compiled once per engine and tokenizer, first

# One feature each; bounded strings and numbers so that uniform sampling ends well within the cap.
_POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
_SEGMENT = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
FEATURES: dict[str, dict] = {
    "maxLength": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]},
    "minimum/maximum": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 17}}, "required": ["n"]},
    "enum": {"type": "object", "properties": {"c": {"enum": ["red", "green", 7, None]}}, "required": ["c"]},
    "$ref/$defs (nested)": {
        "type": "object",
        "$defs": {"point": _POINT, "segment": _SEGMENT},
        "properties": {"seg": {"$ref": "#/$defs/segment"}},
        "required": ["seg"],
        "additionalProperties": False,
    },
    "additionalProperties: false": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False
    },
    "required ordering": {
        "type": "object",
        "properties": {"z": {"type": "boolean"}, "a": {"type": "boolean"}, "m": {"type": "boolean"}},
        "required": ["z", "a", "m"],
        "additionalProperties": False,
    },
}  # fmt: skip

# Single characters after a prefix, on the character-level tokenizer: (schema, prefix, next,
# whether JSON allows it there).
PROBES: dict[str, tuple[dict, str, str, bool]] = {
    "raw tab in a plain string": ({"type": "string"}, '"', "\t", False),
    "raw tab in a string with maxLength": ({"type": "string", "maxLength": 6}, '"', "\t", False),
    "raw tab in a string with minLength": ({"type": "string", "minLength": 1}, '"', "\t", False),
    "escape in a string with maxLength": ({"type": "string", "maxLength": 6}, '"', "\\", True),
    "the \\/ escape": ({"type": "string"}, '"\\', "/", True),
    "leading zero of an integer": ({"type": "integer"}, "0", "1", False),
}


@dataclass(frozen=True)
class Mode:
    name: str
    tokenizers: tuple[int, ...]  # 0: the built-in character-level one, else a BPE vocabulary size
    grammars: tuple[str, ...]
    replays: int
    feature_samples: int
    gil_trials: int
    conversion_repeats: int
    compiles: int  # the compile time is the least of these many
    max_tokens: int = MAX_TOKENS


MODES = {
    "full": Mode("grammar_backends", (0, 32_000, 128_000), tuple(GRAMMARS), 10, 3, 100, 200, 5),
    "quick": Mode("grammar_backends.quick", (0, 32_000), tuple(GRAMMARS), 5, 3, 50, 100, 3),
    "smoke": Mode("grammar_backends.smoke", (0,), ("json_object", "flat"), 1, 1, 5, 3, 1, max_tokens=40),
}


# --- tokenizers --------------------------------------------------------------------------------


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


# --- measurements ------------------------------------------------------------------------------


def sample(matcher: Matcher, case: TokenizerCase, rng: random.Random, max_tokens: int) -> list[int]:
    """Tokens by a uniform choice among the allowed ids, until end of sequence or max_tokens."""
    bitmask, tokens, eos = new_bitmask(case.vocab_size), [], case.tokenizer.eos_token_id
    while len(tokens) < max_tokens and (not tokens or tokens[-1] != eos):
        matcher.fill(bitmask)
        allowed = allowed_ids(bitmask, case.vocab_size)
        if len(allowed) == 0:
            raise GrammarError("empty mask before the grammar stopped")
        token = int(allowed[rng.randrange(len(allowed))])
        if not matcher.consume(token):
            raise GrammarError(f"the matcher refused token {token} its own mask allowed")
        tokens.append(token)
    assert tokens[-1] != eos or matcher.stopped(), "the matcher took end of sequence but goes on"
    return tokens


def replay(matcher: Matcher, tokens: list[int], vocab_size: int) -> tuple[list[float], list[float]]:
    """Seconds per mask and per consume along a fixed token sequence (the matcher starts fresh)."""
    bitmask, fills, consumes = new_bitmask(vocab_size), [], []
    for token in tokens:
        t0 = time.perf_counter()
        matcher.fill(bitmask)
        t1 = time.perf_counter()
        matcher.consume(token)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        consumes.append(t2 - t1)
    return fills, consumes


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def decoded_json(case: TokenizerCase, tokens: list[int]) -> object | None:
    """The sampled text parsed, or None if the sequence did not reach the end of the grammar."""
    if not tokens or tokens[-1] != case.tokenizer.eos_token_id:
        return None
    return json.loads(case.tokenizer.decode(tokens[:-1], skip_special_tokens=True))


def grammar_row(engine: Engine, info: object, case: TokenizerCase, grammar: str, mode: Mode) -> dict:
    schema = GRAMMARS[grammar]
    compile_s = float("inf")
    for _ in range(mode.compiles):  # each one cold: neither engine keeps a cache here
        started = time.perf_counter()
        compiled = engine.compile(info, schema)
        matcher = engine.matcher(compiled)
        compile_s = min(compile_s, time.perf_counter() - started)
    tokens = sample(matcher, case, random.Random(SEED), mode.max_tokens)
    # Per step the least of the replays (a shared machine's interruptions are not the engine's), then
    # statistics over the steps of the sequence.
    replays = [replay(engine.matcher(compiled), tokens, case.vocab_size) for _ in range(mode.replays)]
    fills = [min(step) for step in zip(*(f for f, _ in replays))]
    consumes = [min(step) for step in zip(*(c for _, c in replays))]
    per_token = [min(f + c for f, c in step) for step in zip(*(zip(f, c) for f, c in replays))]
    value = decoded_json(case, tokens)
    valid = None if value is None else _validates(value, schema)
    return {
        "engine": engine.name, "tokenizer": case.name, "vocab_size": case.vocab_size, "grammar": grammar,
        "compile_ms": compile_s * 1e3, "tokens": len(tokens), "completed": value is not None, "valid": valid,
        "mean_us": statistics.fmean(per_token) * 1e6, "median_us": statistics.median(per_token) * 1e6,
        "p99_us": p99(per_token) * 1e6,
        "mask_mean_us": statistics.fmean(fills) * 1e6, "consume_mean_us": statistics.fmean(consumes) * 1e6,
        "token_ids": tokens,
    }  # fmt: skip


def _validates(value: object, schema: dict) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def busy_loop(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def runs_during(call: Callable[[], None], trials: int) -> dict[str, float]:
    """The fraction of trials in which the main thread ran Python while a thread was inside `call`,
    and when it got back (median, as a fraction of the call's time: 1 or more, only after it).

    The thread sets an event and enters the call; the main thread, woken by the event, notes the
    time as soon as it holds the GIL; the thread notes when the call returned. A call that keeps
    the GIL cannot be overtaken (the switch interval is longer than the call), so any overtaking
    shows that it lets go; a busy machine may hide some (the main thread not scheduled in time)."""
    interval, back = sys.getswitchinterval(), []
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        for _ in range(trials):
            entered, times = threading.Event(), [0.0, 0.0]

            def run() -> None:
                times[0] = time.perf_counter()
                entered.set()
                call()
                times[1] = time.perf_counter()

            thread = threading.Thread(target=run)
            thread.start()
            entered.wait()
            woke = time.perf_counter()
            thread.join()
            back.append((woke - times[0]) / (times[1] - times[0]))
    finally:
        sys.setswitchinterval(interval)
    return {"overtaken": sum(b < 1 for b in back) / trials, "median_back_at": statistics.median(back)}


def heaviest_mask(engine: Engine, info: object, case: TokenizerCase, rows: list[dict]) -> tuple[float, str, list[int]]:
    """Seconds, grammar and prefix of its sampled sequence where this engine's mask took longest."""
    best = (-1.0, "", [])
    for row in rows:
        compiled = engine.compile(info, GRAMMARS[row["grammar"]])
        replays = [replay(engine.matcher(compiled), row["token_ids"], case.vocab_size)[0] for _ in range(3)]
        fills = [min(step) for step in zip(*replays)]  # an interruption is not a heavy mask
        step = max(range(len(fills)), key=fills.__getitem__)
        best = max(best, (fills[step], row["grammar"], row["token_ids"][:step]))
    return best


def gil_check(engine: Engine, info: object, case: TokenizerCase, rows: list[dict], trials: int) -> dict:
    """The engine's heaviest mask of the sampled sequences, each trial by a fresh matcher brought to
    that state beforehand (a matcher may keep what it worked out, and a repeat be far cheaper);
    a pure-Python loop as long as the mask is the GIL-holding reference."""
    mask_s, grammar, prefix = heaviest_mask(engine, info, case, rows)
    compiled = engine.compile(info, GRAMMARS[grammar])
    bitmask = new_bitmask(case.vocab_size)
    pool = []
    for _ in range(trials):
        matcher = engine.matcher(compiled)
        for token in prefix:
            matcher.consume(token)
        pool.append(matcher)
    masks = runs_during(lambda: pool.pop().fill(bitmask), trials)
    python = runs_during(lambda: busy_loop(mask_s), trials)
    return {"tokenizer": case.name, "grammar": grammar, "at_token": len(prefix), "mask_us": mask_s * 1e6,
            "trials": trials, "load_average_1m": os.getloadavg()[0], "switch_interval_s": SWITCH_INTERVAL_S,
            "overtaken_mask": masks["overtaken"], "back_at_mask": masks["median_back_at"],
            "overtaken_python": python["overtaken"], "back_at_python": python["median_back_at"],
            "releases_gil": gil_verdict(masks["overtaken"], python["overtaken"])}  # fmt: skip


def gil_verdict(masks: float, python: float) -> bool | None:
    """Overtaken in most trials: it lets go; as seldom as the pure-Python reference: it keeps the
    GIL; None in between, or when the reference was overtaken more than rarely (a thread descheduled
    for a whole switch interval on a busy machine loses the GIL whatever it runs)."""
    if python > 0.1:
        return None
    if masks >= max(0.5, python + 0.3):
        return True
    return False if masks <= python + 0.05 else None


def feature_row(engine: Engine, info: object, case: TokenizerCase, feature: str, samples: int) -> dict:
    schema = FEATURES[feature]
    try:
        compiled = engine.compile(info, schema)
    except GrammarError as e:
        return {"engine": engine.name, "feature": feature, "compiles": str(e)[:200], "honoured": None}
    verdicts = []
    for seed in range(samples):
        tokens = sample(engine.matcher(compiled), case, random.Random(seed), 2000)
        value = decoded_json(case, tokens)
        if value is None:
            verdicts.append("did not finish")
        elif not _validates(value, schema):
            verdicts.append(f"violates: {json.dumps(value)[:80]}")
        elif feature == "required ordering" and list(value) != list(schema["properties"]):
            verdicts.append(f"order {list(value)}")
        else:
            verdicts.append("ok")
    honoured = sum(v == "ok" for v in verdicts)
    detail = next((v for v in verdicts if v != "ok"), "")
    return {"engine": engine.name, "feature": feature, "compiles": "ok", "honoured": f"{honoured}/{samples}",
            "detail": detail}  # fmt: skip


def probe_row(engine: Engine, info: object, case: TokenizerCase, probe: str) -> dict:
    schema, prefix, text, json_allows = PROBES[probe]
    matcher = engine.matcher(engine.compile(info, schema))
    for token in case.tokenizer.encode(prefix, add_special_tokens=False):
        assert matcher.consume(token), f"{engine.name} refused the probe's prefix {prefix!r}"
    bitmask = new_bitmask(case.vocab_size)
    matcher.fill(bitmask)
    allowed = case.tokenizer.convert_tokens_to_ids(text) in set(allowed_ids(bitmask, case.vocab_size).tolist())
    return {"engine": engine.name, "probe": probe, "allowed": allowed, "as_json": allowed == json_allows}


def conversion_row(engine: Engine, info: object, case: TokenizerCase, repeats: int) -> dict:
    """Mask -> torch.bool of vocabulary size, at the start of json_object (min over repeats, µs)."""
    matcher = engine.matcher(engine.compile(info, GRAMMARS["json_object"]))
    bitmask = new_bitmask(case.vocab_size)
    matcher.fill(bitmask)
    row = {"engine": engine.name, "tokenizer": case.name, "vocab_size": case.vocab_size,
           "bitmask_to_bool_us": _min_us(lambda: allowed_mask(bitmask, case.vocab_size), repeats)}  # fmt: skip
    logit_bias = getattr(matcher, "logit_bias", None)
    if logit_bias is not None:
        raw = logit_bias()
        row["logit_bias_compute_us"] = _min_us(logit_bias, repeats)
        row["frombuffer_to_bool_us"] = _min_us(lambda: bias_to_bool(raw), repeats)
        assert torch.equal(bias_to_bool(raw), allowed_mask(bitmask, case.vocab_size)), "the two mask forms disagree"
    row["bitmask_compute_us"] = _min_us(lambda: matcher.fill(bitmask), repeats)
    if engine.name == "llguidance":  # its torch helper, as a server would call it (its checks, a row view)
        started = time.perf_counter()
        import llguidance.torch

        row["llguidance_torch_import_ms"] = (time.perf_counter() - started) * 1e3
        inner = matcher._m
        row["torch_helper_compute_us"] = _min_us(lambda: llguidance.torch.fill_next_token_bitmask(inner, bitmask), repeats)
    return row


def bias_to_bool(raw: bytes) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: we only read it
        return torch.frombuffer(raw, dtype=torch.uint8).bool()


def _min_us(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e6


def dependencies() -> dict[str, dict]:
    out = {}
    for name in ENGINES:
        try:
            requires = [r for r in importlib.metadata.requires(name) or [] if "extra ==" not in r]  # runtime only
            out[name] = {"version": importlib.metadata.version(name), "requires": requires}
        except importlib.metadata.PackageNotFoundError:
            out[name] = {"version": None, "requires": []}
    return out


def run(mode: Mode) -> dict:
    engines = [cls() for name, cls in ENGINES.items() if importlib.util.find_spec(name) is not None]
    data = {"mode": mode.name, "seed": SEED, "max_tokens": mode.max_tokens, "replays": mode.replays,
            "engines": [e.name for e in engines], "dependencies": dependencies(), "rows": [], "tokenizer_info": [],
            "gil": [], "features": [], "probes": [], "conversion": [], "agreement": []}  # fmt: skip
    cases = [tokenizer_case(v) for v in mode.tokenizers]
    for case in cases:
        for engine in engines:
            started = time.perf_counter()
            info = engine.tokenizer_info(case)
            built = time.perf_counter()
            engine.matcher(engine.compile(info, WARM_UP))  # the engine's own one-off set-up, out of the rows
            data["tokenizer_info"].append({"engine": engine.name, "tokenizer": case.name, "vocab_size": case.vocab_size,
                                           "build_ms": (built - started) * 1e3,
                                           "first_compile_ms": (time.perf_counter() - built) * 1e3})  # fmt: skip
            for grammar in mode.grammars:
                data["rows"].append(grammar_row(engine, info, case, grammar, mode))
                print(_progress(data["rows"][-1]), flush=True)
            data["conversion"].append(conversion_row(engine, info, case, mode.conversion_repeats))
            if case is cases[-1]:
                rows = [r for r in data["rows"] if r["engine"] == engine.name and r["tokenizer"] == case.name]
                data["gil"].append({"engine": engine.name, **gil_check(engine, info, case, rows, mode.gil_trials)})
            if case is cases[0]:
                data["features"] += [feature_row(engine, info, case, f, mode.feature_samples) for f in FEATURES]
                data["probes"] += [probe_row(engine, info, case, p) for p in PROBES]
    if len(engines) == 2:
        for case in cases:
            infos = [engine.tokenizer_info(case) for engine in engines]
            for grammar in mode.grammars:
                tokens = next(r["token_ids"] for r in data["rows"] if r["tokenizer"] == case.name and r["grammar"] == grammar)
                matchers = [e.matcher(e.compile(i, GRAMMARS[grammar])) for e, i in zip(engines, infos)]
                data["agreement"].append({"tokenizer": case.name, "grammar": grammar,
                                          **first_disagreement(matchers, case, tokens)})  # fmt: skip
    return data


def first_disagreement(matchers: list[Matcher], case: TokenizerCase, tokens: list[int]) -> dict:
    """Walks one engine's sampled sequence through both matchers; the first step where their
    allowed sets differ, and what only each allows there."""
    for step, token in enumerate(tokens):
        allowed = []
        for matcher in matchers:
            bitmask = new_bitmask(case.vocab_size)
            matcher.fill(bitmask)
            allowed.append(set(allowed_ids(bitmask, case.vocab_size).tolist()))
        if allowed[0] != allowed[1]:
            shown = [sorted(a - b)[:5] for a, b in ((allowed[0], allowed[1]), (allowed[1], allowed[0]))]
            return {"steps": len(tokens), "agree": False, "first_difference_at": step,
                    "after_text": case.tokenizer.decode(tokens[:step])[-24:],
                    "only_first": [case.tokenizer.decode([i]) for i in shown[0]], "n_only_first": len(allowed[0] - allowed[1]),
                    "only_second": [case.tokenizer.decode([i]) for i in shown[1]], "n_only_second": len(allowed[1] - allowed[0])}  # fmt: skip
        for matcher in matchers:
            matcher.consume(token)
    return {"steps": len(tokens), "agree": True}


def _progress(r: dict) -> str:
    return (f"{r['engine']:<10} {r['tokenizer']:<9} {r['grammar']:<12} compile {r['compile_ms']:8.2f} ms  "
            f"{r['mean_us']:8.1f} µs/token (p99 {r['p99_us']:.1f}) over {r['tokens']} tokens")  # fmt: skip


# --- report ------------------------------------------------------------------------------------


def markdown(data: dict) -> str:
    env, cpu = data["environment"], data["environment"]["cpu"]
    deps = data["dependencies"]
    versions = ", ".join(f"{n} {d['version'] or 'not installed'}" for n, d in deps.items())
    out = [
        "# Grammar engines for constrained decoding: llguidance vs xgrammar\n\n"
        f"{versions}; CPU {cpu['model']} ({', '.join(cpu['simd_flags'])}), {env['cpu_count']} cores, "
        f"torch {env['torch']}, load average at start {[round(v, 2) for v in env['load_average_1_5_15m']]}. "
        f"JSON with separators \", \" and \": \" and no free whitespace. Per token: compute the next-token "
        f"bitmask + consume the token, along a sequence sampled uniformly among the allowed ids (seed "
        f"{data['seed']}, at most {data['max_tokens']} tokens), replayed {data['replays']}×: per step the least of "
        "the replays, then mean, median and p99 over the steps. Compile: the least of a few cold compiles.\n"
    ]
    if not data["engines"]:
        return out[0] + "\nNo grammar engine is installed: nothing measured.\n"
    out.append("\n## Per token and compile\n\n")
    rows = [[r["tokenizer"], r["grammar"], r["engine"], r["tokens"], "yes" if r["completed"] else "cap",
             {True: "yes", False: "NO", None: "—"}[r["valid"]], format_number(r["compile_ms"], 2),
             format_number(r["mean_us"]), format_number(r["median_us"]), format_number(r["p99_us"]),
             format_number(r["mask_mean_us"]), format_number(r["consume_mean_us"])] for r in data["rows"]]  # fmt: skip
    out.append(markdown_table(["tokenizer", "grammar", "engine", "tokens", "ended", "valid", "compile ms",
                               "µs/token mean", "median", "p99", "mask µs (mean)", "consume µs (mean)"],
                              rows, "lllrllrrrrrr"))  # fmt: skip
    if data["agreement"] and len(data["engines"]) == 2:
        first, second = data["engines"]
        out.append(f"\n## Do the masks agree?\n\n{first}'s sampled sequence walked through both engines: the first "
                   f"step where the allowed sets differ, and (up to 5 of) the tokens only one allows there.\n\n")  # fmt: skip
        out.append(markdown_table(
            ["tokenizer", "grammar", "steps", "agree", "first difference at", "after text", f"only {first}", f"only {second}"],
            [[a["tokenizer"], a["grammar"], a["steps"], "yes" if a["agree"] else "no", a.get("first_difference_at", "—"),
              _code(a["after_text"]) if "after_text" in a else "",
              _shown(a, "first"), _shown(a, "second")] for a in data["agreement"]],
            "llrlrlll",
        ))  # fmt: skip
    out.append("\n## Tokenizer info (one-off)\n\n")
    out.append("The first compile of a tokenizer (a small array schema) holds the engine's one-off set-up; "
               "the rows above come after it.\n\n")
    out.append(markdown_table(["tokenizer", "engine", "build ms", "first compile ms"],
                              [[r["tokenizer"], r["engine"], format_number(r["build_ms"], 2),
                                format_number(r["first_compile_ms"], 2)] for r in data["tokenizer_info"]]))  # fmt: skip
    out.append("\n## Does the mask computation release the GIL?\n\n"
               "A thread computes the engine's heaviest mask of the sampled sequences (a fresh matcher at that "
               "state each trial) while the main thread, woken as the call starts, notes when it holds the GIL "
               "again. With a switch interval longer than the call, a call that keeps the GIL is never overtaken "
               "(as the pure-Python reference, a loop as long as the mask, is not); any overtaking shows it lets "
               "go. \"Back at\": when the main thread held the GIL again, as a fraction of the call's time (median). "
               "On a busy machine the main thread may wake too late to overtake a short call.\n\n")  # fmt: skip
    out.append(markdown_table(
        ["engine", "tokenizer / grammar", "mask µs", "trials", "overtaken (mask)", "back at (mask)",
         "overtaken (Python)", "back at (Python)", "load 1 min", "releases"],
        [[g["engine"], f"{g['tokenizer']} / {g['grammar']} @ token {g['at_token']}", format_number(g["mask_us"]),
          g["trials"], f"{g['overtaken_mask']:.0%}", f"{g['back_at_mask']:.0%}", f"{g['overtaken_python']:.0%}",
          f"{g['back_at_python']:.0%}", f"{g['load_average_1m']:.1f}", _yes_no(g["releases_gil"])]
         for g in data["gil"]],
        "llrrrrrrrl",
    ))  # fmt: skip
    out.append("\n## Schema features (character tokenizer; samples validated with jsonschema)\n\n")
    out.append(markdown_table(
        ["feature", "engine", "compiles", "honoured", "detail"],
        [[f["feature"], f["engine"], f["compiles"], f["honoured"] or "—", f.get("detail") or ""] for f in data["features"]],
        "lllll",
    ))  # fmt: skip
    out.append("\n## Single-character probes (character tokenizer): is the next character allowed?\n\n")
    engines = data["engines"]
    probes = {(p["probe"], p["engine"]): p for p in data["probes"]}
    verdict = {(True, True): "yes", (False, True): "no", (True, False): "yes: invalid JSON", (False, False): "no: stricter"}
    out.append(markdown_table(
        ["probe", "schema", "after", "next", "JSON allows", *engines],
        [[name, "`" + json.dumps(PROBES[name][0]) + "`", _code(PROBES[name][1]), _code(PROBES[name][2]),
          "yes" if PROBES[name][3] else "no",
          *[verdict[probes[name, e]["allowed"], probes[name, e]["as_json"]] for e in engines]]
         for name in PROBES if all((name, e) in probes for e in engines)],
        "lllll" + "l" * len(engines),
    ))  # fmt: skip
    out.append("\n## Mask -> torch.bool of vocabulary size (min µs)\n\n")
    out.append("At the start of json_object. \"via llguidance.torch\": the same bitmask through that module's "
               "helper (checks and a row view in Python); importing that module took "
               + next((f"{c['llguidance_torch_import_ms']:,.0f} ms" for c in data["conversion"]
                       if "llguidance_torch_import_ms" in c), "—")
               + " (it compiles a torch kernel when imported).\n\n")  # fmt: skip
    out.append(markdown_table(
        ["tokenizer", "engine", "bitmask compute", "via llguidance.torch", "bitmask -> bool", "logit_bias compute",
         "frombuffer -> bool"],
        [[c["tokenizer"], c["engine"], format_number(c["bitmask_compute_us"]),
          format_number(c.get("torch_helper_compute_us")), format_number(c["bitmask_to_bool_us"]),
          format_number(c.get("logit_bias_compute_us")), format_number(c.get("frombuffer_to_bool_us"))]
         for c in data["conversion"]],
    ))  # fmt: skip
    out.append("\n## Recommendation\n\n" + recommendation(data) + "\n")
    return "".join(out)


def _yes_no(verdict: bool | None) -> str:
    return {True: "yes", False: "no", None: "unclear"}[verdict]


def _code(text: str) -> str:
    """Text as a JSON string in a code span that a table cell can hold."""
    return "`" + json.dumps(text).replace("`", "'").replace("|", "\\|") + "`"


def _shown(a: dict, side: str) -> str:
    if a["agree"]:
        return ""
    tokens = " ".join(_code(t) for t in a[f"only_{side}"])
    return f"{a[f'n_only_{side}']}: {tokens}" if tokens else "0"


def recommendation(data: dict) -> str:
    """Derived from the numbers above, so that it follows a rerun."""
    engines = data["engines"]
    if len(engines) < 2:
        return f"Only {', '.join(engines)} was measured: no comparison."
    tokenizers = sorted({(r["vocab_size"], r["tokenizer"]) for r in data["rows"]})
    target = next((name for _, name in tokenizers if name == "bpe-32k"), tokenizers[-1][1])
    smallest = tokenizers[0][1]

    def gmean(engine: str, key: str, tokenizer: str) -> float:
        return statistics.geometric_mean(
            [r[key] for r in data["rows"] if r["engine"] == engine and r["tokenizer"] == tokenizer]
        )

    def worst(engine: str, key: str) -> dict:
        return max((r for r in data["rows"] if r["engine"] == engine and r["tokenizer"] == target), key=lambda r: r[key])

    per_token = {e: gmean(e, "mean_us", target) for e in engines}
    fast, slow = sorted(engines, key=per_token.get)
    small = {e: gmean(e, "mean_us", smallest) for e in engines}
    compile_ms = {e: gmean(e, "compile_ms", target) for e in engines}
    complete = {e: sum(f["honoured"] is not None and f["honoured"].split("/")[0] == f["honoured"].split("/")[1]
                       for f in data["features"] if f["engine"] == e) for e in engines}  # fmt: skip
    invalid = {e: [p["probe"] for p in data["probes"] if p["engine"] == e and p["allowed"] and not p["as_json"]] for e in engines}
    stricter = {e: [p["probe"] for p in data["probes"] if p["engine"] == e and not p["allowed"] and not p["as_json"]] for e in engines}
    releases = {g["engine"]: g["releases_gil"] for g in data["gil"]}
    requires = {e: sorted({_requirement_name(r) for r in data["dependencies"][e]["requires"]}) for e in engines}
    n_features = len({f["feature"] for f in data["features"]})
    slowest = {e: worst(e, "p99_us") for e in engines}
    text = (
        f"On the {target} tokenizer {fast} takes {per_token[fast]:.1f} µs per token (mask + consume, geometric mean "
        f"over the grammars) and {slow} {per_token[slow]:.1f} µs ({per_token[slow] / per_token[fast]:.1f}×); the worst "
        f"p99 is {slowest[fast]['p99_us']:.0f} µs ({fast}, {slowest[fast]['grammar']}) vs {slowest[slow]['p99_us']:.0f} µs "
        f"({slow}, {slowest[slow]['grammar']}). "
        + ("" if smallest == target else f"On the {smallest} tokenizer: " + ", ".join(f"{e} {small[e]:.1f} µs" for e in engines) + ". ")
        + "Cold compile on " + target + ": " + ", ".join(f"{e} {compile_ms[e]:.2f} ms" for e in engines)
        + f" (geometric mean). Schema features compiled and honoured in every sample: "
        + ", ".join(f"{e} {complete[e]}/{n_features}" for e in engines)
        + ". Probes where an engine allows invalid JSON: "
        + "; ".join(f"{e}: {', '.join(invalid[e]) or 'none'}" for e in engines)
        + "; where it refuses valid JSON: "
        + "; ".join(f"{e}: {', '.join(stricter[e]) or 'none'}" for e in engines)
        + ". Mask computation releases the GIL: "
        + ", ".join(f"{e} {_yes_no(releases.get(e))}" for e in engines)
        + ". Runtime dependencies: "
        + "; ".join(f"{e}: {', '.join(requires[e]) or 'none'}" for e in engines)
        + ". "
    )
    lighter = min(engines, key=lambda e: len(requires[e]))
    if fast == lighter and not invalid[fast] and complete[fast] >= complete[slow]:
        return text + f"Recommendation: {fast}: faster per token on the realistic vocabulary, no invalid JSON, and the lighter install."
    return text + (f"Recommendation: a trade-off: {fast} is faster per token on {target}; {lighter} is the lighter "
                   f"install; invalid-JSON probes: {', '.join(f'{e} {len(invalid[e])}' for e in engines)}.")  # fmt: skip


def _requirement_name(requirement: str) -> str:
    """"torch>=2; python_version > '3'" -> "torch"."""
    name = requirement.split(";")[0].strip()
    for stop in "<>=!~[ (":
        name = name.split(stop)[0]
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="the 104 and 32k tokenizers, fewer replays")
    group.add_argument("--smoke", action="store_true", help="the 104-id tokenizer, two grammars: proves it runs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    torch.set_num_threads(1)
    env = environment_info()
    data = {"environment": env, **run(mode)}
    json_path, md_path = write_results(mode.name, data, markdown(data), args.results_dir)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
