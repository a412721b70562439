"""The product's promise as a property under faults (bench/chaos/driver.py): what every client
was told — chat conversations, Responses chains with forks and DELETEs, stateless full-history
clients — is what the service holds; a replay by Idempotency-Key equals the live answer; a
conversation idle past its TTL is a clean 404; greedy outputs equal a fault-free replay.
`python -m bench.chaos` runs the same driver longer.

The run has a Redis and cache service of its own (a small state tier that spills, a TTL of
seconds) and its own app beside the session's, so its faults and retention touch no other test.
"""

from __future__ import annotations

import pytest
from ray import serve

from bench.chaos.driver import ChaosRun
from bench.chaos.plan import ClientKind, Fault
from bench.chaos.run import APP, QUICK, StackInfrastructure, app_args, chaos_services
from deployments.app import build_app

pytestmark = pytest.mark.timeout(480)

PREFIX = "/chaos"


@pytest.fixture(scope="module")
def chaos_stack(stack, tmp_path_factory):
    with chaos_services(tmp_path_factory.mktemp("chaos"), QUICK) as (redis, service):
        serve.run(build_app(app_args(stack.model_dir, service, QUICK)), name=APP, route_prefix=PREFIX)
        try:
            yield StackInfrastructure(redis, service, APP)
        finally:
            serve.delete(APP)


async def test_what_clients_were_told_is_what_the_service_holds(stack, chaos_stack):
    await chaos_stack.settled()
    report = await ChaosRun(QUICK, stack.base_url + PREFIX, stack.model, chaos_stack).run()
    print(report.as_dict())  # the counts, in the test log
    assert report.divergences == []
    assert report.committed == QUICK.conversations * QUICK.turns
    assert set(report.committed_by_kind) == set(ClientKind)
    injected = {fault for fault, n in report.faults.items() if n}
    assert injected == set(Fault), f"faults not exercised: {set(Fault) - injected}"
    assert report.replays and report.forks and report.deletes and report.expiries
    assert report.attempts > report.committed  # the faults cost clients attempts: the property was tested
