"""Engine benchmark: `python -m bench.engine [--quick] [--arch bamba]`.

Our `LLMEngine` against `transformers` `generate` on the same random-weight checkpoint
(`bench` preset), on the CPU, side by side in one process:

    decode tokens/s at concurrency 1, 8, 32 (quick: 1, 8)
    prefill tokens/s (prompt tokens / time to the first token of every sequence)

Both sides generate greedily exactly `new_tokens` tokens per sequence from the same
prompts (ours: SamplingParams(temperature=0, max_tokens=N, ignore_eos=True); theirs:
do_sample=False, use_cache=True, min_new_tokens=max_new_tokens=N, left padding).
Every run is split at the same event on both sides:

    t0 ──── prefill ────> t_first ──────── decode ────────> t_end
    (inputs ready)     every sequence has     all sequences have
                       its first token        their N tokens

    prefill tokens/s = concurrency * prompt_len / (t_first - t0)
    decode tokens/s  = tokens produced after t_first / (t_end - t_first)

Ours: t_first is taken between engine steps; theirs: from a streamer whose `put` is
called once with the prompt and once per generated step (the second call is t_first).
Our scheduler may run some decodes of early sequences inside the prefill window
(chunked prefill); those tokens count for neither throughput, the window's time for
prefill. Process CPU time of each window is recorded too: the machine may be shared.

Writes bench/results/engine.{json,md,png} (a quick run: engine.quick.*).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import RESULTS_DIR, environment_info, format_number, markdown_table, write_results
from workers.checkpoint import Arch, Preset, make_model, preset_shape
from workers.checkpoint.tokens import ORDINARY_TOKEN_IDS, PAD_TOKEN_ID
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling import SamplingParams

TARGET_RATIO, TARGET_MIN_CONCURRENCY = 2.0, 8
CONTENDED_FRACTION = 0.75  # a run with less CPU/wall than this share of its threads ran on a busy machine


class Side(str, Enum):
    OURS = "ours"
    TRANSFORMERS = "transformers"


@dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    repeats: int


FULL = Plan(concurrency=(1, 8, 32), prompt_len=128, new_tokens=64, repeats=3)
QUICK = Plan(concurrency=(1, 8), prompt_len=128, new_tokens=16, repeats=1)


@dataclass(frozen=True)
class Run:
    side: Side
    concurrency: int
    repeat: int
    prompt_tokens: int
    generated_tokens: int
    decode_tokens: int
    prefill_s: float  # t_first - t0
    decode_s: float  # t_end - t_first
    prefill_cpu_s: float
    decode_cpu_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s

    def as_dict(self) -> dict:
        d = asdict(self) | {"side": self.side.value}
        return d | {"prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}


class _Clock:
    """Wall and process-CPU time together."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def since(self, start: _Clock) -> tuple[float, float]:
        return self.wall - start.wall, self.cpu - start.cpu


def make_prompts(concurrency: int, length: int, seed: int) -> list[list[int]]:
    """Random ids from the ordinary (non-special) vocabulary; same seed, same prompts for both sides."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(ORDINARY_TOKEN_IDS.start, ORDINARY_TOKEN_IDS.stop, (concurrency, length), generator=g)
    return ids.tolist()


class OursRunner:
    def __init__(self, model_dir: Path, threads: int):
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), num_threads=threads))
        self._next_id = 0

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[Run, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        ids = [f"bench-{self._next_id + i}" for i in range(len(prompts))]
        self._next_id += len(prompts)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        without_first, first, produced_before_first = len(ids), None, 0
        t0 = _Clock()
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, prompt, params)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error:
                    raise RuntimeError(out.error)
                if not tokens[out.request_id] and out.new_tokens:
                    without_first -= 1
                tokens[out.request_id].extend(out.new_token_ids)
            if first is None and without_first == 0:
                first = _Clock()
                produced_before_first = sum(len(t) for t in tokens.values())
        end = _Clock()
        self.engine.check_integrity()
        outputs = [tokens[rid] for rid in ids]
        generated = sum(len(t) for t in outputs)
        return _run(Side.OURS, prompts, generated, generated - produced_before_first, t0, first, end), outputs


class TransformersRunner:
    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[Run, list[list[int]]]:
        from transformers.generation.streamers import BaseStreamer

        class StepClock(BaseStreamer):
            def __init__(self) -> None:
                self.clocks: list[_Clock] = []

            def put(self, value) -> None:
                self.clocks.append(_Clock())

            def end(self) -> None:
                pass

        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = StepClock()
        t0 = _Clock()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=PAD_TOKEN_ID,
                streamer=clock,
            )
        end = _Clock()
        outputs = out[:, width:].tolist()
        generated = sum(len(t) for t in outputs)
        first = clock.clocks[1]  # clocks[0]: the prompt, put before the prefill forward
        return _run(Side.TRANSFORMERS, prompts, generated, generated - len(prompts), t0, first, end), outputs


def _run(side: Side, prompts, generated: int, decode_tokens: int, t0: _Clock, first: _Clock, end: _Clock) -> Run:
    prefill_s, prefill_cpu = first.since(t0)
    decode_s, decode_cpu = end.since(first)
    return Run(
        side, len(prompts), 0, sum(len(p) for p in prompts), generated, decode_tokens,
        prefill_s, decode_s, prefill_cpu, decode_cpu,
    )  # fmt: skip


def benchmark(plan: Plan, model_dir: Path, threads: int, seed: int) -> tuple[list[Run], dict[str, float], int]:
    """Runs every (concurrency, repeat) on both sides; returns the runs, first-token agreement, parameters."""
    torch.set_num_threads(threads)
    runners = {Side.OURS: OursRunner(model_dir, threads), Side.TRANSFORMERS: TransformersRunner(model_dir)}
    torch.set_num_threads(threads)  # the engine sets it too; make sure both sides use the same
    warmup = make_prompts(2, plan.prompt_len, seed + 1)
    for side, runner in runners.items():
        runner.run(warmup, 4)
    runs: list[Run] = []
    agreement: dict[str, float] = {}
    tasks = [(c, r) for c in plan.concurrency for r in range(plan.repeats)]
    with tqdm(total=2 * len(tasks), desc="engine bench", unit="run") as bar:
        for c, r in tasks:
            prompts = make_prompts(c, plan.prompt_len, seed + 1000 * c + r)
            # Alternate which side goes first so slow drift in machine load hits both alike.
            order = [Side.OURS, Side.TRANSFORMERS] if r % 2 == 0 else [Side.TRANSFORMERS, Side.OURS]
            outputs = {}
            for side in order:
                bar.set_postfix_str(f"{side.value} c={c} rep={r}")
                gc.collect()
                run, outputs[side] = runners[side].run(prompts, plan.new_tokens)
                if any(len(t) != plan.new_tokens for t in outputs[side]):
                    raise RuntimeError(f"{side.value} did not generate exactly {plan.new_tokens} tokens per sequence")
                runs.append(replace(run, repeat=r))
                bar.update()
            agreement[str(c)] = _first_token_agreement(outputs[Side.OURS], outputs[Side.TRANSFORMERS])
    parameters = sum(p.numel() for p in runners[Side.TRANSFORMERS].model.parameters())
    return runs, agreement, parameters


def _first_token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Share of sequences whose first greedy token matches (a sanity check on the comparison)."""
    return sum(a[0] == b[0] for a, b in zip(ours, theirs)) / len(ours)


def summarize(runs: list[Run], plan: Plan) -> dict:
    def median(side: Side, c: int, metric: str) -> float:
        return statistics.median(getattr(r, metric) for r in runs if r.side is side and r.concurrency == c)

    out: dict = {}
    for metric in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        per_side = {s.value: {str(c): median(s, c, metric) for c in plan.concurrency} for s in Side}
        out[metric] = per_side
        out[f"{metric}_ratio_vs_transformers"] = {
            str(c): per_side["ours"][str(c)] / per_side["transformers"][str(c)] for c in plan.concurrency
        }
    checked = [c for c in plan.concurrency if c >= TARGET_MIN_CONCURRENCY]
    out["target"] = {
        "decode_ratio_at_least": TARGET_RATIO,
        "at_concurrency_at_least": TARGET_MIN_CONCURRENCY,
        "met": bool(checked) and all(out["decode_tokens_per_s_ratio_vs_transformers"][str(c)] >= TARGET_RATIO for c in checked),
    }
    return out


METHOD = {
    "timing": "one process, both sides; torch.set_num_threads(threads) for both; one warm-up run per side "
    "(2 sequences, 4 new tokens) before measuring; sides alternate which goes first per repeat; medians over repeats",
    "prompts": "fixed length, random ids from the ordinary (non-special) vocabulary, the same prompts for both sides",
    "generation": "greedy; ours SamplingParams(temperature=0, max_tokens=N, ignore_eos=True); transformers "
    "generate(do_sample=False, use_cache=True, max_new_tokens=N, min_new_tokens=N), left padding; "
    "both checked to produce exactly N tokens per sequence",
    "phases": "t0 = inputs ready; t_first = every sequence has its first token (ours: between engine steps; "
    "transformers: second streamer.put, i.e. after the prefill forward and first sampling); t_end = generation done",
    "prefill_tokens_per_s": "concurrency * prompt_len / (t_first - t0)  (time to first token of the whole batch)",
    "decode_tokens_per_s": "tokens produced after t_first / (t_end - t_first); transformers: concurrency * (N - 1); "
    "ours: the same minus decodes the chunked-prefill scheduler already ran before t_first",
    "cpu_seconds": "process CPU time of each window (user+sys, both threads) recorded beside wall time; "
    "cpu/wall well below the thread count means the machine was shared during the run",
}


def markdown(results: dict) -> str:
    s, plan = results["summary"], results["settings"]
    cs = [str(c) for c in plan["concurrency"]]
    decode_rows = [
        [c, format_number(s["decode_tokens_per_s"]["ours"][c]), format_number(s["decode_tokens_per_s"]["transformers"][c]),
         f"{s['decode_tokens_per_s_ratio_vs_transformers'][c]:.2f}×"]
        for c in cs
    ]  # fmt: skip
    prefill_rows = [
        [c, format_number(s["prefill_tokens_per_s"]["ours"][c]), format_number(s["prefill_tokens_per_s"]["transformers"][c]),
         f"{s['prefill_tokens_per_s_ratio_vs_transformers'][c]:.2f}×"]
        for c in cs
    ]  # fmt: skip
    run_rows = [
        [r["side"], r["concurrency"], r["repeat"], f"{r['prefill_s']:.2f}", f"{r['prefill_cpu_s']:.2f}",
         f"{r['decode_s']:.2f}", f"{r['decode_cpu_s']:.2f}", f"{_cores_used(r):.2f}", r["decode_tokens"]]
        for r in results["runs"]
    ]  # fmt: skip
    contended = [r for r in results["runs"] if _cores_used(r) < CONTENDED_FRACTION * plan["threads"]]
    warning = (
        f"**Shared machine:** {len(contended)} of {len(results['runs'])} runs got less than "
        f"{CONTENDED_FRACTION:.0%} of {plan['threads']} cores (CPU/wall column); absolute tokens/s are depressed "
        "by other processes, ratios less so (the sides run back to back on the same prompts)."
        if contended
        else "Every run had its threads' cores (CPU/wall close to the thread count)."
    )
    env, model, target = results["environment"], results["model"], s["target"]
    verdict = "met" if target["met"] else "NOT met"
    return "\n".join([
        f"# Engine benchmark ({'quick' if plan['quick'] else 'full'})",
        "",
        f"`{model['arch']}` / `{model['preset']}` preset, {model['parameters'] / 1e6:.1f}M parameters, fp32, CPU, "
        f"{plan['threads']} threads; prompts of {plan['prompt_len']} tokens, {plan['new_tokens']} new tokens per "
        f"sequence, greedy; torch {env['torch']}, transformers {env.get('transformers', '?')}.",
        "",
        "## Decode tokens/s",
        "",
        markdown_table(["concurrency", "ours tok/s", "transformers tok/s", "ratio"], decode_rows),
        f"Target (ours ≥ {target['decode_ratio_at_least']:g}× transformers at concurrency ≥ "
        f"{target['at_concurrency_at_least']}): **{verdict}**.",
        "",
        "## Prefill tokens/s (time to first token of the batch)",
        "",
        markdown_table(["concurrency", "ours tok/s", "transformers tok/s", "ratio"], prefill_rows),
        "## Runs (seconds; CPU = process CPU time of the window)",
        "",
        markdown_table(
            ["side", "concurrency", "repeat", "prefill s", "prefill CPU s", "decode s", "decode CPU s", "CPU/wall",
             "decode tokens"],
            run_rows,
        ),
        warning,
        "",
        f"Method: {results['method']['phases']}. Decode = {results['method']['decode_tokens_per_s']}. "
        f"Load average at start / end: {env['load_average_1_5_15m']} / {results['load_average_at_end']}. "
        "Full details in engine.json.",
        "",
    ])  # fmt: skip


def _cores_used(run: dict) -> float:
    """Process CPU seconds per wall second over the whole run (about `threads` on an idle machine)."""
    return (run["prefill_cpu_s"] + run["decode_cpu_s"]) / (run["prefill_s"] + run["decode_s"])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]["decode_tokens_per_s"]
    cs = results["settings"]["concurrency"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for side, marker in (("ours", "o"), ("transformers", "s")):
        ax.plot(cs, [s[side][str(c)] for c in cs], marker=marker, label=side)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency (sequences decoding together)")
    ax.set_ylabel("decode tokens/s")
    m = results["model"]
    ax.set_title(f"{m['arch']} / {m['preset']} on CPU ({results['settings']['threads']} threads)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def checkpoint_dir(arch: Arch, preset: Preset, seed: int, model_dir: Path | None) -> Path:
    """The checkpoint (deterministic in arch, preset, seed), written once outside the repo."""
    out = model_dir or Path(tempfile.gettempdir()) / "hybridserve-bench" / f"{arch.value}-{preset.value}-seed{seed}"
    if not (out / "model.safetensors").exists() or not (out / "hybridserve.json").exists():
        make_model(out, arch, preset, seed)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 8, 16 new tokens (~2 minutes)")
    parser.add_argument("--arch", type=Arch, choices=list(Arch), default=Arch.BAMBA)
    parser.add_argument("--preset", type=Preset, choices=list(Preset), default=Preset.BENCH)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None, help="measured runs per side and concurrency")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="checkpoint and prompt seed")
    parser.add_argument("--model-dir", type=Path, default=None, help="where to write/reuse the checkpoint")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    plan = QUICK if args.quick else FULL
    plan = Plan(plan.concurrency, plan.prompt_len, args.new_tokens or plan.new_tokens, args.repeats or plan.repeats)
    torch.set_num_threads(args.threads)
    env = environment_info()
    model_dir = checkpoint_dir(args.arch, args.preset, args.seed, args.model_dir)
    started = time.perf_counter()
    runs, agreement, parameters = benchmark(plan, model_dir, args.threads, args.seed)
    shape = preset_shape(args.arch, args.preset)
    summary = summarize(runs, plan)
    results = {
        "benchmark": "engine",
        "environment": env,
        "load_average_at_end": list(os.getloadavg()),
        "wall_seconds": time.perf_counter() - started,
        "model": {
            "arch": args.arch.value,
            "preset": args.preset.value,
            "seed": args.seed,
            "parameters": parameters,
            "dtype": "float32",
            "hidden_size": shape.hidden_size,
            "layer_pattern": shape.layer_pattern,
            "checkpoint": str(model_dir),
        },
        "settings": asdict(plan) | {"threads": args.threads, "quick": args.quick},
        "method": METHOD,
        "summary": summary,
        "decode_tokens_per_s_ratio_vs_transformers": summary["decode_tokens_per_s_ratio_vs_transformers"],
        "first_token_agreement": agreement,
        "runs": [r.as_dict() for r in runs],
    }
    name = "engine.quick" if args.quick else "engine"
    json_path, md_path = write_results(name, results, markdown(results), args.results_dir)
    plot(results, args.results_dir / f"{name}.png")
    print(markdown(results))
    print(f"wrote {json_path}, {md_path}, {args.results_dir / f'{name}.png'}")
    return results


if __name__ == "__main__":
    main()
