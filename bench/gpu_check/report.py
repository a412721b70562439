"""The Markdown of a run (results.json holds every number) and its pass/fail summary."""

from __future__ import annotations

from bench.kit.tables import format_number, markdown_table


def _g(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def verdicts(results: dict) -> dict[str, bool]:
    out = {f"logits {r['model']}": r["passed"] for r in results["logits"]}
    out["conversation turn == recompute"] = results["conversation"]["passed"]
    if "prompt_logprobs" in results:  # runs before it existed have none
        out["prompt logprobs == transformers"] = results["prompt_logprobs"]["passed"]
    out.update({f"deterministic {r['model']}": r["passed"] for r in results["determinism"]})
    return out


def markdown(results: dict) -> str:
    env, plan = results["environment"], results["plan"]
    device = results["device"]
    lines = [
        f"# GPU check{' (smoke)' if plan['smoke'] else ''}: {device['name']}",
        "",
        f"`python -m bench.gpu_check{' --smoke' if plan['smoke'] else ''}` on {device['name']} "
        f"({device['type']}), torch {env['torch']}, transformers {env.get('transformers', '?')}, "
        f"{results['wall_s']:.0f} s in all. Each check is described in its module (`bench/gpu_check/`).",
        "",
        "## Checks",
        "",
        markdown_table(["check", "result"], [[k, "pass" if v else "**FAIL**"] for k, v in verdicts(results).items()]),
        "## Logits vs transformers (same device)",
        "",
        "max |ours - transformers fp32| / std; bf16 bound = 1.5 x what transformers' own bf16 is off by.",
        "",
        markdown_table(
            ["model", "prompt", "fp32 error", "bf16 error", "transformers bf16", "bf16 bound"],
            [[r["model"], r["prompt_tokens"], _g(r["fp32_error"]), _g(r["bf16_error"]),
              _g(r["bf16_transformers_error"]), _g(r["bf16_bound"])] for r in results["logits"]],
        ),  # fmt: skip
        "## Conversation turn vs full recompute (fp32)",
        "",
        markdown_table(["prompt", "cached", "reply", "tokens equal", "max logprob diff"], [[
            results["conversation"]["prompt_tokens"], results["conversation"]["cached_tokens"],
            results["conversation"]["reply_tokens"], results["conversation"]["tokens_equal"],
            _g(results["conversation"]["max_logprob_diff"])]]),  # fmt: skip
        *_prompt_logprobs(results.get("prompt_logprobs")),
        "## Deterministic requests alone vs under load (bf16)",
        "",
        markdown_table(["model", "requests", "beside", "tokens each", "bit-identical"], [
            [r["model"], r["requests"], r["load_requests"], r["tokens_each"], f"{r['bit_identical']}/{r['requests']}"]
            for r in results["determinism"]]),  # fmt: skip
    ]
    speed = results.get("throughput")
    if speed:
        lines += [
            f"## Throughput, bf16: {speed['model']} ({speed['parameters'] / 1e6:,.1f}M parameters)",
            "",
            f"{speed['prompt_len']}-token prompts, {speed['new_tokens']} new tokens each; tokens/s.",
            "",
            markdown_table(
                ["side", "c", "prefill tok/s", "decode tok/s", "prefill s", "decode s"],
                [[r["side"], r["concurrency"], format_number(r["prefill_tokens_per_s"]),
                  format_number(r["decode_tokens_per_s"]), f"{r['prefill_s']:.3f}", f"{r['decode_s']:.3f}"]
                 for r in speed["runs"]],
            ),  # fmt: skip
            markdown_table(["c", "prefill ours/transformers", "decode ours/transformers"], [
                [c, _g(v["prefill_tokens_per_s"]), _g(v["decode_tokens_per_s"])]
                for c, v in speed["ours_over_transformers"].items()]),  # fmt: skip
        ]
    return "\n".join(lines)


def _prompt_logprobs(r: dict | None) -> list[str]:
    if not r or "max_error" not in r:
        return []
    return ["## Prompt logprobs vs transformers' log_softmax (fp32)", "",
            markdown_table(["prompt", "prefill chunk", "tokens right", "max error", "bound"],
                           [[r["prompt_tokens"], r["chunk"], r["tokens_right"], _g(r["max_error"]), _g(r["bound"])]])]


def summary(results: dict) -> str:
    checks = verdicts(results)
    failed = [k for k, v in checks.items() if not v]
    head = f"gpu_check on {results['device']['name']}: {len(checks) - len(failed)}/{len(checks)} checks passed"
    return head + ("" if not failed else "\nFAILED: " + ", ".join(failed))
