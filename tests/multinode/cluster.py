"""A Ray cluster of several nodes on this one machine, each node its own `ray start --block`.

    head   (`ray start --head`): GCS, Serve's controller and proxy, the ingress      {hs_head: 1}
    node a (`ray start --address head`): a raylet and what it runs                   {hs_worker: 1, hs_node_a: 1}
    node b, node c, ...                                                              {hs_worker: 1, hs_node_b: 1}

Every node gets ports of its own (raylet, object manager, agents, workers): on one machine the
defaults collide. `--block` keeps each node's processes under one launcher, so losing a node is
killing that launcher's process tree (`ray stop` would stop every node here, and the session
Ray of other tests with them). Also `python -m tests.multinode.cluster` to start one by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import ray

RAY = str(Path(sys.executable).with_name("ray"))
HEAD_RESOURCE = "hs_head"
WORKER_RESOURCE = "hs_worker"  # one per worker node: each Worker replica takes one (its ray_actor_options)
PORTS_PER_NODE = 6
WORKER_PORTS = 40  # core worker processes a node may run at once


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_range(width: int) -> int:
    """The first of `width` consecutive ports none listens on (the workers' range)."""
    for _ in range(100):
        start = free_ports(1)[0]
        if start + width >= 65535:
            continue
        holders = [socket.socket() for _ in range(width)]
        try:
            for i, s in enumerate(holders):
                s.bind(("127.0.0.1", start + i))
            return start
        except OSError:
            continue
        finally:
            for s in holders:
                s.close()
    raise RuntimeError(f"no {width} free consecutive ports")


def node_resource(name: str) -> str:
    return f"hs_node_{name}"


@dataclass
class Node:
    name: str
    launcher: subprocess.Popen  # `ray start --block`: the parent of the node's raylet and agents
    log: Path
    node_id: str = ""  # the GCS's, once registered

    def processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.launcher.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """The machine goes away: every process of the node at once, by SIGKILL, nothing told."""
        for process in self.processes():  # the whole tree is listed before anything dies
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.launcher.wait()


class LocalCluster:
    def __init__(self, *, head_cpus: int = 1):
        # A short root: Ray's unix sockets live under it and a socket path has ~107 bytes at most.
        self.root = Path(tempfile.mkdtemp(prefix="hs-ray-", dir="/tmp"))
        # Token authentication (on by default for `ray start` in this Ray) would need a token file
        # shared by the nodes and the driver; the cluster only listens on this machine.
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
        self.port = free_ports(1)[0]
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, Node] = {}
        head = self._launch("head", ["--head", f"--port={self.port}", "--include-dashboard=false",
                                     f"--ray-client-server-port={free_ports(1)[0]}",
                                     f"--dashboard-port={free_ports(1)[0]}"], head_cpus, {HEAD_RESOURCE: 1})
        try:
            self._await(head, lambda: "Ray runtime started" in head.log.read_text())
            # This process is the cluster's driver, on the head node (Ray prefers it among the nodes
            # of one host), so losing a worker node never takes the caller with it.
            ray.init(address=self.address, log_to_driver=False)
            head.node_id = self._registered_id(HEAD_RESOURCE)
        except BaseException:
            self.stop()
            raise

    def add_worker_nodes(self, names: str, cpus: int = 1) -> None:
        """Worker nodes named by the letters of `names`, started side by side."""
        started = [self._launch(name, [f"--address={self.address}"], cpus,
                                {WORKER_RESOURCE: 1, node_resource(name): 1}) for name in names]
        for node in started:
            self._await(node, lambda: self._registered_id(node_resource(node.name)))
            node.node_id = self._registered_id(node_resource(node.name))

    def _launch(self, name: str, role: list[str], cpus: int, resources: dict[str, float]) -> Node:
        manager, objects, agent_http, agent_grpc, env_agent, metrics = free_ports(PORTS_PER_NODE)
        first_worker = free_port_range(WORKER_PORTS)
        log = self.root / f"{name}.log"
        command = [RAY, "start", *role, "--block", f"--num-cpus={cpus}", "--num-gpus=0",
                   f"--resources={json.dumps(resources)}", f"--temp-dir={self.root / name}",
                   f"--node-manager-port={manager}", f"--object-manager-port={objects}",
                   f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
                   f"--runtime-env-agent-port={env_agent}", f"--metrics-export-port={metrics}",
                   f"--min-worker-port={first_worker}", f"--max-worker-port={first_worker + WORKER_PORTS - 1}",
                   "--object-store-memory=100000000", "--disable-usage-stats"]
        with log.open("wb") as out:
            launcher = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                        start_new_session=True)
        node = self.nodes[name] = Node(name, launcher, log)
        return node

    @staticmethod
    def _await(node: Node, ready, timeout_s: float = 120) -> None:
        """Until `ready()`: `ray start --block` announces nothing once its node has joined (the
        head's log line aside), so the GCS's node list is polled."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.launcher.poll() is not None:
                raise RuntimeError(f"node {node.name} exited {node.launcher.returncode}:\n{node.log.read_text()}")
            if ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"node {node.name} did not join within {timeout_s} s:\n{node.log.read_text()}")

    @staticmethod
    def _registered_id(resource: str) -> str:
        """The alive node holding `resource` (one node's own), or "" (this process is the driver)."""
        return next((info["NodeID"] for info in ray.nodes() if info["Alive"] and resource in info["Resources"]), "")

    def node_names(self) -> dict[str, str]:
        """Node id -> name, for every node started (dead ones included)."""
        return {node.node_id: name for name, node in self.nodes.items()}

    def alive_node_names(self) -> set[str]:
        """The nodes the GCS lists alive, less those killed here (it notices only seconds later)."""
        names = self.node_names()
        return {names[info["NodeID"]] for info in ray.nodes()
                if info["Alive"] and info["NodeID"] in names and self.nodes[names[info["NodeID"]]].launcher.poll() is None}

    def drain(self, name: str, deadline_s: int = 120) -> None:
        """A preemption notice for the node (what an autoscaler sends before it removes a machine):
        Serve starts replacements of the node's replicas elsewhere, then stops them gracefully."""
        subprocess.run([RAY, "drain-node", f"--address={self.address}", f"--node-id={self.nodes[name].node_id}",
                        "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=scale-in",
                        f"--deadline-remaining-seconds={deadline_s}"], check=True, env=self.env, capture_output=True)

    def stop(self) -> None:
        ray.shutdown()
        for node in reversed(list(self.nodes.values())):  # nothing is kept: no need to stop them gently
            node.kill()
        shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    cluster = LocalCluster()
    cluster.add_worker_nodes("abcdefgh"[:workers])
    print(f"RAY_ADDRESS={cluster.address}  ({workers} worker nodes; Ctrl-C stops the cluster)", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
