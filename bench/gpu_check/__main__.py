"""Runs every check of `bench.gpu_check` (see its docstring), writes the results, prints the verdict."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.kit.environment import environment_info
from bench.kit.results import RESULTS_DIR, write_results
from bench.gpu_check import conversation, determinism, logits, prompt_logprobs, throughput
from bench.gpu_check.plan import FULL, LOGIT_MODELS, SMOKE, SPEED_ARCH, SPEED_SHAPE, Models, exact_fp32
from bench.gpu_check.plan import parameter_count, pick_device, write_speed_model
from bench.gpu_check.report import markdown, summary

DET_MODELS = ("granite", "nemotron-moe")


def _guarded(what: str, fn: Callable[[], dict], **fields) -> dict:
    """A check's result; one that raises is a failure carrying its traceback (the run goes on)."""
    started = time.perf_counter()
    print(f"[gpu_check] {what} ...", flush=True)
    try:
        result = fn()
    except Exception:  # noqa: BLE001 - recorded in the results and counted as a failed check
        result = {**fields, "passed": False, "error": traceback.format_exc()}
        print(result["error"], file=sys.stderr, flush=True)
    result["seconds"] = time.perf_counter() - started
    print(f"[gpu_check] {what}: {'pass' if result['passed'] else 'FAIL'} ({result['seconds']:.1f} s)", flush=True)
    return result


def _device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": "cpu", "name": "CPU"}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": props.name, "memory_gib": props.total_memory / 2**30,
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}  # fmt: skip


def _environment() -> dict:
    try:
        return environment_info()
    except OSError as e:  # no git on the machine: the rest still says what ran
        import transformers

        return {"torch": torch.__version__, "transformers": transformers.__version__, "note": str(e)}


def run(device: torch.device, smoke: bool, work: Path) -> dict:
    plan = SMOKE if smoke else FULL
    exact_fp32(device)
    started = time.perf_counter()
    models = Models(work, plan)
    results: dict = {"device": _device_info(device), "plan": dataclasses.asdict(plan)}
    results["logits"] = [_guarded(f"logits {name}", lambda n=name: logits.check_model(
        n, models.path(n), plan.logit_prompt, device), model=name) for name, _, _ in LOGIT_MODELS]  # fmt: skip
    results["conversation"] = _guarded(
        "conversation", lambda: conversation.check(models.path("granite"), device, plan.turns, plan.reply_tokens))
    results["prompt_logprobs"] = _guarded("prompt logprobs", lambda: prompt_logprobs.check(
        models.path("granite"), device, plan.logit_prompt, plan.logit_prompt // 3))
    results["determinism"] = [_guarded(f"deterministic {name}", lambda n=name: determinism.check(
        n, models.path(n), device, plan.det_requests, plan.det_load, plan.det_tokens), model=name) for name in DET_MODELS]
    def speed() -> dict:
        speed_dir = write_speed_model(work, plan)
        measured = throughput.measure(speed_dir, device, plan.concurrency, plan.prompt_len, plan.new_tokens)
        name = f"{SPEED_ARCH.value} {'tiny' if smoke else 'bench preset scaled up'}"
        shape = None if smoke else dataclasses.asdict(SPEED_SHAPE)
        return {**measured, "model": name, "shape": shape, "parameters": parameter_count(speed_dir), "passed": True}

    results["throughput"] = _guarded("throughput", speed)
    results["wall_s"] = time.perf_counter() - started
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny models, seconds (what a CPU run does anyway)")
    parser.add_argument("--device", help="cpu or cuda[:N]; default: cuda if present, else cpu")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    smoke = args.smoke or device.type != "cuda"
    if smoke and not args.smoke:
        print("[gpu_check] no CUDA device here: running the smoke plan on the CPU", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        results = run(device, smoke, Path(work))
    results["environment"] = _environment()
    name = "gpu.smoke" if smoke else "gpu"
    json_path, md_path = write_results(name, results, markdown(results), args.results_dir)
    text = summary(results)
    print(text, f"\nresults: {json_path} {md_path}", flush=True)
    return 0 if "FAILED" not in text else 1


if __name__ == "__main__":
    sys.exit(main())
