"""Each measurement of the grammar backends: masks, GIL, features, conversions."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable

import jsonschema
import torch

from bench.grammar_backends.engines import (
    ENGINES,
    Engine,
    GrammarError,
    Matcher,
    TokenizerCase,
    allowed_ids,
    allowed_mask,
    new_bitmask,
)
from bench.grammar_backends.plan import FEATURES, GRAMMARS, PROBES, SEED, SWITCH_INTERVAL_S, WARM_UP, Mode
from bench.grammar_backends.tokenizers import tokenizer_case
from bench.kit.stats import nearest_rank


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
        "p99_us": nearest_rank(per_token, 0.99) * 1e6,
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
