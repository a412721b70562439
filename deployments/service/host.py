"""The cache service started for the app when no address is configured.

A deployment owns a `python -m cache_service` child process (which in turn starts the
embedded redis-server unless a Redis URL is given). The child is started through util-linux
`setpriv --pdeathsig TERM` so it goes when the replica goes, however the replica dies.
Readiness is the service's own `serving` log line, which also carries the bound port.

The service listens on the node's address, so it always requires a shared secret: the one of
`cache_service_token_file`, else a random one made here. The secret goes to the child through
its stdin (`--auth-token-file /dev/stdin`: never on disk or in its argv), and to the app's
clients through `CacheService.endpoint()`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import ray
from ray import serve

from deployments.settings import AppSettings

log = logging.getLogger("hybridserve.cache_host")
_REPO_ROOT = Path(__file__).resolve().parents[1]


def _die_with_parent() -> list[str]:
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM"] if setpriv and sys.platform.startswith("linux") else []


class CacheServiceProcess:
    """One `python -m cache_service` child; `address` once it serves."""

    def __init__(self, settings: AppSettings, host: str, start_timeout_s: float = 60.0):
        data_dir = Path(settings.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.auth_token = settings.read_cache_service_token() or secrets.token_urlsafe(32)
        argv = [*_die_with_parent(), sys.executable, "-m", "cache_service", "--host", host, "--port", "0",
                "--data-dir", str(data_dir), "--auth-token-file", "/dev/stdin"]
        if settings.redis_url:
            argv += ["--redis-url", settings.redis_url]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        env.pop("REDIS_URL", None)  # the flag above is the only source
        self.proc = subprocess.Popen(argv, cwd=_REPO_ROOT, env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.proc.stdin.write(self.auth_token)
        self.proc.stdin.close()
        self.port = 0
        self._ready = threading.Event()
        threading.Thread(target=self._drain, name="cache-service-log", daemon=True).start()
        if not self._ready.wait(start_timeout_s) or self.port == 0:
            self.proc.kill()
            raise RuntimeError(f"the cache service did not start (exit code {self.proc.poll()})")
        self.address = f"{host}:{self.port}"

    def _drain(self) -> None:
        for line in self.proc.stderr:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                log.info("cache service: %s", line.rstrip())
                continue
            if event.get("event") == "serving":
                self.port = int(event["port"])
                self._ready.set()
            elif event.get("level") in ("WARNING", "ERROR"):
                log.warning("cache service: %s", line.rstrip())
        self._ready.set()  # EOF: the process exited

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@serve.deployment(name="CacheService", num_replicas=1, ray_actor_options={"num_cpus": 0.1})
class CacheService:
    def __init__(self, settings: AppSettings):
        # The node's own address: reachable from the other nodes' replicas, not every interface.
        self._process = CacheServiceProcess(settings, host=ray.util.get_node_ip_address())

    def address(self) -> str:
        return self._process.address

    def endpoint(self) -> tuple[str, str]:
        """(address, shared secret) for the app's clients."""
        return self._process.address, self._process.auth_token

    def check_health(self) -> None:
        if self._process.proc.poll() is not None:
            raise RuntimeError(f"the cache service exited with {self._process.proc.returncode}")

    def __del__(self) -> None:
        self._process.stop()
