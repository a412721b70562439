"""The serving-overhead baseline: the worker's engine configuration stepped in process."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from bench.kit.results import REPO_ROOT
from bench.serve.plan import Plan, overhead_script


class InProcessReference:
    """The overhead probe's conversations in an engine stepped in this process, configured as a
    Worker replica configures its own (deployments/worker/engine_session.py) from config.yaml's args."""

    def __init__(self, plan: Plan, model_dir: Path):
        import torch

        from deployments.settings import RETAIN_TURNS, AppSettings
        from workers.conversation.cache import ConversationCache
        from workers.engine import LLMEngine

        (application,) = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())["applications"]
        settings = AppSettings.model_validate(application["args"] | {"model": str(model_dir)})
        torch.set_num_threads(settings.torch_threads)
        self.plan, self.threads = plan, settings.torch_threads
        # The worker's own mapping (EngineSession builds its engine and cache the same way); stepped
        # here synchronously, without the worker's engine thread.
        self.engine = LLMEngine(settings.engine_config(str(model_dir)))
        self.cache = ConversationCache(self.engine, retain_turns=RETAIN_TURNS)

    def _turn(self, conv: str, messages: list[dict], max_tokens: int, request_id: str) -> tuple[float, object]:
        from proto.contract import ConversationRef
        from workers.sampling import SamplingParams

        t0 = time.perf_counter()
        request = self.cache.begin_turn(ConversationRef(conv, "bench"), messages,
                                        SamplingParams(max_tokens=max_tokens, temperature=0), request_id)
        first = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error:
                    raise RuntimeError(out.error)
                if first is None and out.new_tokens:
                    first = time.perf_counter() - t0
        return first, request

    def probe(self, k: int) -> tuple[float, int, int]:
        """Turn 1 of probe conversation k, then turn 2 measured: (TTFT, prompt tokens, reused tokens)."""
        script, conv = overhead_script(self.plan, k), f"oh{k}"
        self._turn(conv, [{"role": "system", "content": script.system}, {"role": "user", "content": script.users[0]}],
                   script.replies[0], f"{conv}-1")
        ttft, request = self._turn(conv, [{"role": "user", "content": script.users[1]}], script.replies[1], f"{conv}-2")
        return ttft, request.num_prompt_tokens, request.num_cached_tokens
