"""One real Ray Serve application for the whole session.

    Redis (EmbeddedRedis, AOF) <── python -m cache_service <── ChatIngress / 2 Worker replicas
                                                               ^ official `openai` client over HTTP

Ray starts once per session. Redis and the cache service are processes of the test (not of
the app) so tests can kill and restart them; the app is given the service's address. The
model is a tiny random Bamba checkpoint made once per session.
"""

from __future__ import annotations

import json
import socket
import uuid
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import ray
from ray import serve

from cache_service.config import FsyncPolicy
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from deployments.app import ChatIngress, Worker, build_app
from deployments.settings import AppSettings
from tests.cache_service.cs_helpers import ServiceProcess
from workers.checkpoint import Arch, Preset, make_model

APP = "hybridserve"
NOTIER_APP = "hybridserve-notier"
BUILTIN_APP = "hybridserve-builtin"
# Names the session's app serves its model under besides the checkpoint's (served_model_name);
# the first is the canonical one its replies carry.
SERVED_NAMES = ("hybridserve-test/tiny-bamba", "tiny")
# The model never ends a reply (never_ending): a request without max_tokens runs to this cap or
# to the context's end, whichever comes first (max_output_tokens).
MAX_OUTPUT_TOKENS = 4000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ray(attempts: int = 3, **init_args) -> None:
    """ray.init, tried afresh if the node never comes up.

    Once in about a hundred sessions on these machines the raylet wrote not one log line and
    never registered with the GCS; ray.init then gives up after its fixed 30 s with "The current
    node timed out during startup", and every test of the session failed with it. A new try
    starts a new Ray session, after the processes of the failed one (GCS, monitor, raylet: our
    children that were not there before) are killed. Any other error is raised at once.
    """
    for attempt in range(1, attempts + 1):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            ray.init(**init_args)
            return
        except Exception as error:
            if "timed out during startup" not in str(error) or attempt == attempts:
                raise
            ray.shutdown()
            for child in psutil.Process().children(recursive=True):
                if child.pid not in before:
                    child.kill()
            warnings.warn(f"Ray did not start (attempt {attempt} of {attempts}): {error}")


def never_ending(model_dir: Path) -> Path:
    """Ban the end-of-turn token: every reply runs to max_tokens, so a stream lasts as long as
    a test needs (a replica can be killed mid-stream) and reply lengths are fixed."""
    meta_file = model_dir / "hybridserve.json"
    meta = json.loads(meta_file.read_text())
    meta["never_sample_token_ids"] = sorted(set(meta["never_sample_token_ids"]) | set(meta["eos_token_ids"]))
    meta_file.write_text(json.dumps(meta))
    return model_dir


@dataclass
class ServeStack:
    base_url: str
    model: str
    model_dir: str
    redis: EmbeddedRedis
    service: ServiceProcess

    def client(self, prefix: str = "") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}{prefix}/v1", api_key="unused", max_retries=0,
                                  timeout=120)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=120)


@dataclass
class BuiltinApp:
    url: str  # the app's root: its page, and the API under /v1
    model: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)


def app_args(stack_model: str, service: ServiceProcess, **extra) -> dict:
    return {"model": stack_model, "cache_service": service.target, "kv_cache_mb": 16, "head_cache_mb": 8,
            "max_num_seqs": 8, "lease_ttl_s": 10, "busy_wait_s": 20, **extra}


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model_dir = never_ending(make_model(root / "model", Arch.BAMBA, Preset.TINY, seed=4))
    with ExitStack() as cleanup:  # whatever started is stopped, even if a later step fails
        redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=root / "redis", fsync=FsyncPolicy.ALWAYS))
        cleanup.callback(redis.stop)
        redis.start()
        service = ServiceProcess(data_dir=root / "service", redis_url=redis.url)
        cleanup.callback(service.close)
        service.start()
        cleanup.callback(ray.shutdown)
        # Logical CPUs: a second app (tier off) and replacement replicas must fit beside the first.
        # "local": a Ray of the session's own; without an address ray.init joins the latest live
        # cluster on the machine (another session's, a benchmark's).
        start_ray(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                  runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}})
        cleanup.callback(serve.shutdown)
        port = _free_port()  # after Ray's own processes took theirs
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args(str(model_dir), service, tier_export="async", served_model_name=SERVED_NAMES,
                                     max_output_tokens=MAX_OUTPUT_TOKENS)), name=APP, route_prefix="/")
        yield ServeStack(f"http://127.0.0.1:{port}", model_dir.name, str(model_dir), redis, service)


@pytest.fixture(scope="session")
def notier(stack):
    """A second app on the same cache service: state tier off, API keys on, one request at a time,
    leases of 1.5 s (a turn outlives its lease unless the ingress renews it)."""
    args = app_args(stack.model_dir, stack.service, tier_export="off", api_keys=["k1", "k2"], max_inflight=1,
                    lease_ttl_s=1.5)
    serve.run(build_app(args), name=NOTIER_APP, route_prefix="/notier")
    yield "/notier"
    serve.delete(NOTIER_APP)


@pytest.fixture(scope="module")
def builtin(stack):
    """An app on the default model (`model` empty, as config.yaml has it: the trained built-in
    checkpoint), whose replies are English and end, on the session's cache service. One worker
    replica, and only for the module that asks: its Ray CPU is back for the next module (the
    session's apps and the replacement replicas of the recovery tests share 4)."""
    settings = AppSettings.model_validate(app_args("", stack.service))
    serve.run(ChatIngress.bind(settings, Worker.options(num_replicas=1).bind(settings, None), None),
              name=BUILTIN_APP, route_prefix="/builtin")
    yield BuiltinApp(f"{stack.base_url}/builtin", settings.model_names[0])
    serve.delete(BUILTIN_APP)


@pytest.fixture
def conv_id() -> str:
    return f"conv-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def bare_service(tmp_path_factory):
    """Redis and the cache service without the app (no Ray): for tests that drive the ingress's
    turn code (TurnRun, LeaseKeeper) with stand-in replicas."""
    root = tmp_path_factory.mktemp("bare-service")
    with ExitStack() as cleanup:
        redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=root / "redis", fsync=FsyncPolicy.EVERYSEC))
        cleanup.callback(redis.stop)
        redis.start()
        service = ServiceProcess(data_dir=root / "service", redis_url=redis.url)
        cleanup.callback(service.close)
        service.start()
        yield service
