"""The grammar-backends Markdown and recommendation, from the JSON alone."""

from __future__ import annotations

import json
import statistics

from bench.grammar_backends.plan import PROBES
from bench.kit.tables import format_number, markdown_table


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
