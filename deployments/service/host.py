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

import logging
import secrets
from pathlib import Path

import ray
from ray import serve

from cache_service.launch import CacheServiceChild
from deployments.settings import AppSettings

log = logging.getLogger("hybridserve.cache_host")


def _log_event(event: dict) -> None:
    if event.get("event") == "raw":
        log.info("cache service: %s", event["line"])
    elif event.get("level") in ("WARNING", "ERROR"):
        log.warning("cache service: %s", event)


class CacheServiceProcess:
    """One `python -m cache_service` child; `address` once it serves."""

    def __init__(self, settings: AppSettings, host: str, start_timeout_s: float = 60.0):
        data_dir = Path(settings.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.auth_token = settings.read_cache_service_token() or secrets.token_urlsafe(32)
        args = ["--host", host, "--port", "0", "--data-dir", str(data_dir),
                "--conversation-ttl-s", str(settings.conversation_ttl_s),
                "--redis-maxmemory", f"{settings.redis_maxmemory_mb}MiB"]
        # The Redis URL by environment: it may carry a password, and argv is anyone's to read.
        self.child = CacheServiceChild(args, auth_token=self.auth_token, redis_url=settings.redis_url or None,
                                       die_with_parent=True, on_event=_log_event)
        self.port = self.child.start(start_timeout_s)
        self.address = f"{host}:{self.port}"

    @property
    def proc(self):
        return self.child.proc

    def stop(self) -> None:
        self.child.stop()


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
