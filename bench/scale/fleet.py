"""The router's own code over simulated replicas: `StickyConversationRouter.choose_replicas`,
exactly as Serve calls it, with each replica behind a Serve `RunningReplica` view.

Serve's `RunningReplica` looks up its actor handle when built; a simulated replica has no actor,
so the view takes the replica info alone (the router reads only `replica_id` and
`routing_stats`). After the choice, `on_send_request` is called for the first replica with
room, as Serve does when it sends, and Serve's queue-length cache is set from the replica's live
count when a turn ends (Serve learns it from probes, which the view answers the same way).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from ray.serve._private.common import (DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata,
                                       RunningReplicaInfo)
from ray.serve.request_router import PendingRequest, RunningReplica

from deployments.messages import TurnJob
from deployments.routing.router import StickyConversationRouter

from bench.scale.cost_model import BATCH
from bench.scale.replica import SimulatedReplica

DEPLOYMENT = DeploymentID(name="Worker", app_name="hybridserve")


class ReplicaView(RunningReplica):
    """A simulated replica as Serve's router sees it; its queue-length probe asks the replica."""

    def __init__(self, info: RunningReplicaInfo, replica: SimulatedReplica):  # no actor: nothing is sent to it
        self._replica_info = info
        self._multiplexed_model_ids = set()
        self._replica = replica

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self._replica.in_flight


class Fleet:
    def __init__(self, replicas: list[SimulatedReplica]):
        self.replicas = {r.name: r for r in replicas}
        self.views = [ReplicaView(RunningReplicaInfo(ReplicaID(r.name, DEPLOYMENT), None, None, None, r.name,
                                                     BATCH, routing_stats=r.routing_stats), r)
                      for r in replicas]
        self._ids = {v.replica_id.unique_id: v.replica_id for v in self.views}
        self.router = StickyConversationRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN,
                                               use_replica_queue_len_cache=True)
        self.router.update_replicas(self.views)
        self.route_seconds: list[float] = []
        self.reasons: dict[str, int] = {}
        self._turn_ended = asyncio.Event()

    async def route(self, job: TurnJob) -> SimulatedReplica:
        """The first replica with room in the router's ranks, as Serve sends (a replica at
        max_ongoing_requests, BATCH here, is skipped); with none, it waits for a turn to end and
        asks the router again, as Serve backs off and retries."""
        request = PendingRequest([job], {}, RequestMetadata(job.request_id, uuid.uuid4().hex))
        while True:
            t0 = time.perf_counter()
            ranks = await self.router.choose_replicas(self.views, request)
            self.route_seconds.append(time.perf_counter() - t0)
            room = [v.replica_id for rank in ranks for v in rank
                    if self.replicas[v.replica_id.unique_id].in_flight < BATCH]
            if room:
                self.router.on_send_request(room[0])
                return self.replicas[room[0].unique_id]
            await self._turn_ended.wait()

    def finished(self, replica: SimulatedReplica) -> None:
        self.router.replica_queue_len_cache.update(self._ids[replica.name], replica.in_flight)
        self._turn_ended.set()  # wakes every route waiting for room; the next ones wait on a new event
        self._turn_ended = asyncio.Event()
