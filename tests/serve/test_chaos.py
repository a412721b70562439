"""The product's promise as a property under faults (bench/chaos/driver.py): every client's
view equals the service's ledger, no turn twice, every named head serves a next turn, greedy
outputs equal a fault-free replay. `python -m bench.chaos` runs the same driver longer."""

from __future__ import annotations

import pytest
from tests.serve.conftest import APP

from bench.chaos.driver import ChaosRun, Fault
from bench.chaos.run import QUICK, StackInfrastructure

pytestmark = pytest.mark.timeout(420)


async def test_what_clients_were_told_is_what_the_ledger_holds(stack):
    infra = StackInfrastructure(stack.redis, stack.service, APP)
    await infra.settled()  # no replacement replica still loading from an earlier test
    report = await ChaosRun(QUICK, stack.base_url, stack.model, infra).run()
    print(report.as_dict())  # the counts, in the test log
    assert report.divergences == []
    assert report.committed == QUICK.conversations * QUICK.turns
    injected = {fault for fault, n in report.faults.items() if n}
    assert injected == set(Fault), f"faults not exercised: {set(Fault) - injected}"
    assert report.attempts > report.committed  # the faults cost clients attempts: the property was tested
