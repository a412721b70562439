"""Our app (`serve run` of a config file) and vLLM's OpenAI server, started for a benchmark."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from bench.kit.results import REPO_ROOT
from bench.kit.servers import ServerProcess, free_port


VLLM_MEMORY_FRACTION = "0.3"


# -- our app ---------------------------------------------------------------------------------------
def app_config(model_dir: Path, data_dir: Path, port: int, config_file: str = "config.yaml",
               args: dict | None = None) -> dict:
    """config_file (config.yaml) as users run it, with the benchmark's model, a private data dir,
    loopback only, and `args` set."""
    config = yaml.safe_load((REPO_ROOT / config_file).read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    (application,) = config["applications"]
    application["args"] |= {"model": str(model_dir), "data_dir": str(data_dir)} | (args or {})
    return config


def start_app(model_dir: Path, tmp: Path, config_file: str = "config.yaml", args: dict | None = None,
              name: str = "serve") -> tuple[ServerProcess, str, dict]:
    """`serve run` of config_file; its config, data and log in tmp under `name`."""
    port = free_port()
    config = app_config(model_dir, tmp / f"{name}-data", port, config_file, args)
    path = tmp / f"{name}-config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               RAY_USAGE_STATS_ENABLED="0")
    # A cluster of its own, never someone else's: without an address Ray joins the latest live
    # cluster on this machine (its /tmp/ray/ray_current_cluster), "local" starts a new one.
    env.pop("RAY_ADDRESS", None)
    serve_bin = Path(sys.executable).with_name("serve")
    server = ServerProcess("serve run", [str(serve_bin), "run", "--address", "local", str(path)], env, REPO_ROOT,
                           tmp / f"{name}.log", f"http://127.0.0.1:{port}/health")
    return server, f"http://127.0.0.1:{port}", config


# -- vLLM's OpenAI server ---------------------------------------------------------------------------
class VllmServer:
    """One vLLM OpenAI server configuration, started again on demand after its engine died."""

    def __init__(self, python: Path, model_dir: Path, tmp: Path, mode: str, extra: list[str]):
        self.python, self.model_dir, self.tmp, self.mode, self.extra = python, model_dir, tmp, mode, extra
        self.starts = 0
        self.server: ServerProcess | None = None
        self.startup_s: float | None = None
        self.startup_error: str | None = None
        self._start()

    def _start(self) -> None:
        from workers.vllm_backend.venv import vllm_env

        port = free_port()
        self.argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                     "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", VLLM_MEMORY_FRACTION,
                     "--dtype", "float32", *self.extra]
        self.starts += 1
        self.url = f"http://127.0.0.1:{port}"
        self.server = ServerProcess(f"vllm ({self.mode})", self.argv, vllm_env(), self.tmp,
                                    self.tmp / f"vllm-{self.mode}-{self.starts}.log", f"{self.url}/health")
        try:
            self.startup_s, self.startup_error = self.server.wait_ready(900), None
        except (RuntimeError, TimeoutError) as exc:
            self.startup_s, self.startup_error = None, str(exc)[-3000:]

    def healthy(self) -> bool:
        import httpx

        if self.server is None or not self.server.alive():
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        except httpx.TransportError:
            return False

    def restart_if_dead(self) -> None:
        if not self.healthy():
            self.stop()
            self._start()

    def run(self, work) -> dict:
        """work(base_url)'s record, with the server's start and, after errors, its log."""
        rec: dict = {"command": self.argv, "server_start": self.starts}
        if self.startup_error is not None:
            return rec | {"startup_error": self.startup_error}
        rec["startup_s"] = self.startup_s
        rec |= work(self.url)
        rec["server_alive_after"] = self.healthy()
        if rec["errors"]:
            rec["server_log_tail"] = self.server.tail(40)
            rec["server_log_errors"] = self.server.error_lines()
        return rec

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(30)
            self.server = None
