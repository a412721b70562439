"""The chaos benchmark's plans, the stack it breaks and its report."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import ray
from ray import serve
from tests.cache_service.cs_helpers import ServiceProcess, fast_client

from bench.chaos.driver import ChaosRun
from bench.chaos.plan import ChaosPlan, ClientKind, Fault
from bench.kit.environment import environment_info
from bench.kit.servers import free_port
from bench.kit.tables import markdown_table
from cache_service.config import FsyncPolicy
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from deployments.app import build_app
from workers.checkpoint import Arch, Preset, make_model


APP = "hybridserve-chaos"

# Small enough that the tier spills heads to disk all along (a tiny model's head is tens of KB).
TIER_BUDGET = 256 << 10


FULL = ChaosPlan(conversations=24, turns=17, max_tokens=12, seed=0, infra_every_turns=14, budget_s=540.0)


# The slow fault last: a kill returns only once Serve has noticed it, and the clients must not
# finish their turns before every kind of fault has happened. Every client kind at least twice;
# seed 0 plans two expiries, a DELETE and three forks (the test asserts each happened).
QUICK = ChaosPlan(conversations=8, turns=5, max_tokens=8, seed=0, infra_every_turns=5, budget_s=600.0,
                  expiry_rate=0.08, fork_rate=0.3, delete_rate=0.25,
                  infra_faults=(Fault.PAUSE_REDIS, Fault.SLOW_SERVICE, Fault.RESTART_SERVICE, Fault.KILL_WORKER))


# Proves the run works end to end (one service restart among 3 x 2 turns); measures nothing.
SMOKE = ChaosPlan(conversations=3, turns=2, max_tokens=4, seed=0, infra_every_turns=2,
                  kinds=(ClientKind.CHAT, ClientKind.RESPONSES, ClientKind.STATELESS),
                  infra_faults=(Fault.RESTART_SERVICE,), budget_s=300.0)


class StackInfrastructure:
    """Faults on processes this run started; `app` names the Serve application."""

    def __init__(self, redis: EmbeddedRedis, service: ServiceProcess, app: str):
        self.redis, self.service, self.app = redis, service, app
        self._spills_of_earlier_lives = 0  # the service counts its own spills; a restart starts again at 0

    async def kill_worker(self, replica_id: str, timeout_s: float = 60.0) -> bool:
        """Returns once Serve counts the replica dead: until its next health check it still lists
        it as running, and `settled()` would return with one replica missing. False if the
        replica was gone already (a head can still name an owner killed earlier)."""
        running = await self._running_workers()
        try:
            actor = ray.get_actor(f"SERVE_REPLICA::{self.app}#Worker#{replica_id}", namespace="serve")
        except ValueError:
            return False
        ray.kill(actor, no_restart=True)

        async def noticed() -> None:
            while await self._running_workers() >= running:
                await asyncio.sleep(0.2)

        await asyncio.wait_for(noticed(), timeout_s)
        return True

    async def _running_workers(self) -> int:
        status = (await asyncio.to_thread(serve.status)).applications[self.app]
        return status.deployments["Worker"].replica_states.get("RUNNING", 0)

    async def restart_service(self) -> None:
        self._spills_of_earlier_lives = await self.tier_spills()

        def restart() -> None:
            self.service.terminate()
            self.service.start()

        await asyncio.to_thread(restart)

    async def pause_redis(self, seconds: float) -> None:
        await _pause(self.redis.pid, seconds)

    async def pause_service(self, seconds: float) -> None:
        await _pause(self.service.proc.pid, seconds)

    async def tier_spills(self) -> int:
        async with fast_client(self.service.target) as client:
            return self._spills_of_earlier_lives + (await client.stats()).tier_spills

    async def settled(self) -> None:
        """Serve has no event for a replacement replica coming up: its status is polled."""
        while True:
            status = (await asyncio.to_thread(serve.status)).applications[self.app]
            if status.status == "RUNNING" and all(
                set(d.replica_states) <= {"RUNNING"} for d in status.deployments.values()
            ):
                return
            await asyncio.sleep(0.2)


async def _pause(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)  # the fault is the pause itself
    finally:
        os.kill(pid, signal.SIGCONT)


@contextmanager
def chaos_services(root: Path, plan: ChaosPlan) -> Iterator[tuple[EmbeddedRedis, ServiceProcess]]:
    """Redis and a cache service of the run's own: a small tier, the plan's retention."""
    with ExitStack() as cleanup:
        redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=root / "redis", fsync=FsyncPolicy.ALWAYS))
        cleanup.callback(redis.stop)
        redis.start()
        ttl = str(plan.conversation_ttl_s)
        service = ServiceProcess(data_dir=root / "service", redis_url=redis.url, tier_budget=TIER_BUDGET, extra_env={
            "CACHE_CONVERSATION_TTL_S": ttl, "CACHE_TIER_SWEEP_INTERVAL_S": str(plan.conversation_ttl_s / 4 or 60)})
        cleanup.callback(service.close)
        service.start()
        yield redis, service


def app_args(model: str, service: ServiceProcess, plan: ChaosPlan) -> dict:
    return {"model": model, "cache_service": service.target, "kv_cache_mb": 16, "head_cache_mb": 8,
            "max_num_seqs": 8, "lease_ttl_s": plan.lease_ttl_s, "busy_wait_s": 30, "tier_export": "async",
            "conversation_ttl_s": plan.conversation_ttl_s}


def markdown(result: dict) -> str:
    report = result["report"]
    rows = [["turns attempted", report["attempts"]], ["turns committed (client told success)", report["committed"]]]
    rows += [[f"committed: {kind}", n] for kind, n in report["committed_by_kind"].items()]
    rows += [["attempts failed and told", report["failed_and_told"]]]
    rows += [[f"fault: {kind}", n] for kind, n in report["faults"].items()]
    rows += [["faults injected (tier spills apart)", report["faults_total"]],
             ["replays by Idempotency-Key compared with the live answer", report["replays_compared"]],
             ["Responses forks", report["forks"]], ["Responses DELETEs", report["deletes"]],
             ["conversations seen expired (404, then new)", report["expiries_seen"]],
             ["divergences", len(report["divergences"])], ["wall time (s)", f"{report['wall_s']:.0f}"]]
    plan = result["plan"]
    lines = [f"# Chaos run ({plan['conversations']} clients x {plan['turns']} turns, seed {plan['seed']}, "
             f"conversation TTL {plan['conversation_ttl_s']:g} s, tier budget {TIER_BUDGET >> 10} KiB)", "",
             markdown_table(["", "count"], rows, "lr"), ""]
    if report["divergences"]:
        lines += ["## Divergences", "", *[f"- {d}" for d in report["divergences"]], ""]
    lines += [f"Errors clients saw: {report['errors_seen']}", "", f"CPU: {result['environment'].get('cpu')}"]
    return "\n".join(lines)


def run(plan: ChaosPlan) -> dict:
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as cleanup:
        root = Path(tmp)
        model_dir = make_model(root / "model", Arch.BAMBA, Preset.TINY, seed=4)
        redis, service = cleanup.enter_context(chaos_services(root, plan))
        port = free_port()
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}})
        cleanup.callback(ray.shutdown)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cleanup.callback(serve.shutdown)
        serve.run(build_app(app_args(str(model_dir), service, plan)), name=APP, route_prefix="/")
        chaos = ChaosRun(plan, f"http://127.0.0.1:{port}", model_dir.name, StackInfrastructure(redis, service, APP))
        report = asyncio.run(chaos.run())
    return {"plan": plan.as_dict(), "report": report.as_dict(), "environment": environment_info()}
