"""The router's log of what it sent each replica since its last report (routing/sent_log.py):
choices count until Serve sends them, sends until a report covers them, and nothing it keeps
grows without a bound."""

from __future__ import annotations

from deployments.routing.sent_log import CHOICE_TTL_S, SENT_KEPT, SentLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_choice_becomes_a_send_then_a_report_covers_it():
    wall, mono = Clock(), Clock()
    log = SentLog(clock=wall, monotonic=mono)
    log.choose("r1", "a", 2000.0)
    log.choose("r2", "a", 50.0)
    assert log.unsent() == {"a": 2} and log.since("a", 0.0) == [2000.0, 50.0]
    wall.now += 1
    log.on_send("a")  # the oldest choice of a is the one sent
    assert log.unsent() == {"a": 1} and log.since("a", 0.0) == [2000.0, 50.0]
    assert log.since("a", wall.now) == [50.0]  # a report taken after the send covers it
    log.forget_choice("r2")  # retried: it chooses again
    assert log.since("a", 0.0) == []  # the covered send is gone for good


def test_an_unsent_choice_expires_and_sends_are_bounded():
    wall, mono = Clock(), Clock()
    log = SentLog(clock=wall, monotonic=mono)
    log.choose("lost", "a", 10.0)
    mono.now += CHOICE_TTL_S + 0.1
    assert log.unsent() == {} and log.since("a", 0.0) == []
    for _ in range(SENT_KEPT + 10):  # a replica that never reports
        log.on_send("b")
    assert len(log.since("b", 0.0)) == SENT_KEPT
    log.forget_replicas({"a"})
    assert log.since("b", 0.0) == []
