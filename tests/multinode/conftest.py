"""The app on a Ray cluster of four nodes on this machine (cluster.py), once for the folder.

    head: GCS, Serve controller + proxy, ChatIngress          (the test process is the driver here)
    a, b, c: one `hs_worker` each; 2 Worker replicas take one each, so they run on two different
             nodes and the third is room for a replacement (a test that takes a node away
             first makes sure one is left: `with_spare_node`)
    Redis and the cache service: processes of the test, outside Ray, as in tests/serve

These tests need a Ray of their own: run them in a pytest process without the session Ray of
tests/serve (`pytest -m multinode tests/multinode`).
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from dataclasses import dataclass

import pytest
import ray
from ray import serve

from cache_service.config import FsyncPolicy
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from deployments.app import ChatIngress, Worker
from deployments.settings import AppSettings
from tests.cache_service.cs_helpers import ServiceProcess
from tests.multinode.cluster import HEAD_RESOURCE, WORKER_RESOURCE, LocalCluster, free_ports
from tests.serve.conftest import ServeStack, app_args, never_ending
from workers.checkpoint import Arch, Preset, make_model

APP = "hybridserve-multinode"


@dataclass
class MultinodeApp:
    stack: ServeStack
    cluster: LocalCluster

    def placement(self) -> dict[str, str]:
        """Each running Worker replica's node (by the cluster's node names), as Serve's controller
        reports it."""
        details = serve.context._get_global_client().get_serve_details()
        replicas = details["applications"][APP]["deployments"][Worker.name]["replicas"]
        names = self.cluster.node_names()
        return {r["replica_id"]: names.get(r["node_id"], r["node_id"]) for r in replicas if r["state"] == "RUNNING"}

    async def settled(self, timeout_s: float = 180.0, avoid: str = "") -> dict[str, str]:
        """The placement once Serve runs 2 Worker replicas, on two alive nodes other than `avoid`,
        and nothing else (no replica starting, stopping or awaiting migration). Serve has no
        event for it: polled."""
        async def poll() -> dict[str, str]:
            while True:
                status = (await asyncio.to_thread(serve.status)).applications[APP]
                states = status.deployments[Worker.name].replica_states
                placement = await asyncio.to_thread(self.placement)
                alive = self.cluster.alive_node_names()
                if (states == {"RUNNING": 2} and len(set(placement.values())) == 2
                        and set(placement.values()) <= alive - {avoid}):
                    return placement
                await asyncio.sleep(0.5)

        return await asyncio.wait_for(poll(), timeout_s)

    def with_spare_node(self) -> None:
        """A worker node without a replica, for the replacement of a replica whose node goes (a
        new machine joins when the earlier tests took the spare one)."""
        workers = self.cluster.alive_node_names() - {"head"}
        if len(workers) <= 2:
            self.cluster.add_worker_nodes(next(name for name in "defghijk" if name not in self.cluster.nodes))


def placed(deployment, resources: dict[str, float]):
    """`deployment` whose replicas each also take `resources` (custom resources of some nodes)."""
    return deployment.options(ray_actor_options={**deployment.ray_actor_options, "resources": resources})


@pytest.fixture(scope="package")
def multinode(tmp_path_factory):
    if ray.is_initialized():
        pytest.fail("tests/multinode start a Ray cluster of their own: run them in a pytest process of their own")
    root = tmp_path_factory.mktemp("multinode")
    model_dir = never_ending(make_model(root / "model", Arch.BAMBA, Preset.TINY, seed=4))
    with ExitStack() as cleanup:
        redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=root / "redis", fsync=FsyncPolicy.ALWAYS))
        cleanup.callback(redis.stop)
        redis.start()
        service = ServiceProcess(data_dir=root / "service", redis_url=redis.url)
        cleanup.callback(service.close)
        service.start()
        cluster = LocalCluster()
        cleanup.callback(cluster.stop)
        cluster.add_worker_nodes("abc")
        port = free_ports(1)[0]
        cleanup.callback(serve.shutdown)
        # One proxy, on the head: a proxy per node would bind the same port on this one machine.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        # Heads reach the tier only when a replica shuts down gracefully (or after a minute of
        # quiet): a killed node's conversations recompute from the ledger, a drained node's import.
        settings = AppSettings.model_validate(app_args(str(model_dir), service, tier_export="async",
                                                       tier_export_delay_s=60))
        workers = placed(Worker, {WORKER_RESOURCE: 1}).bind(settings, None)
        serve.run(placed(ChatIngress, {HEAD_RESOURCE: 0.01}).bind(settings, workers, None), name=APP,
                  route_prefix="/")
        yield MultinodeApp(ServeStack(f"http://127.0.0.1:{port}", model_dir.name, str(model_dir), redis, service),
                           cluster)
