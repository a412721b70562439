"""Both engine sessions implement the Session protocol the worker, the recovery ladder and the
tier exporter are typed against (deployments/worker/session.py): every member, with the same
parameters (names, kinds, defaults) and the same async-ness, so neither backend drifts."""

from __future__ import annotations

import inspect
import typing

import pytest

from deployments.worker.engine_session import EngineSession
from deployments.worker.session import Session
from deployments.worker.vllm_session import VllmSession

METHODS = sorted(
    name for name, member in vars(Session).items()
    if not name.startswith("_") and inspect.isfunction(member)
)
PROPERTIES = sorted(name for name, member in vars(Session).items() if isinstance(member, property))
ATTRIBUTES = sorted(Session.__annotations__)


def parameters(function) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_is_read():
    assert {"stream_turn", "commit", "abandon", "holds", "export_state"} <= set(METHODS)
    assert PROPERTIES == ["tool_format"] and ATTRIBUTES == ["prefix_tier", "tokenizer", "use"]


@pytest.mark.parametrize("session", [EngineSession, VllmSession], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_matches(session, name):
    wanted, found = getattr(Session, name), getattr(session, name, None)
    assert found is not None and inspect.isfunction(found), f"{session.__name__} lacks {name}"
    assert parameters(found) == parameters(wanted), f"{session.__name__}.{name} drifted from Session"
    assert inspect.iscoroutinefunction(found) == inspect.iscoroutinefunction(wanted), name


@pytest.mark.parametrize("session", [EngineSession, VllmSession], ids=lambda c: c.__name__)
def test_properties_and_attributes(session):
    for name in PROPERTIES:
        assert isinstance(getattr(session, name, None), property), f"{session.__name__}.{name} is not a property"
    hints = typing.get_type_hints(session)
    for name in ATTRIBUTES:
        assert hints.get(name) == typing.get_type_hints(Session)[name], f"{session.__name__} does not declare {name}"
