"""The session rules: one controller, observers read only, detach keeps it, idle ends it."""

from __future__ import annotations

import pytest

from substrate.errors import ControllerBusy, Unauthorized
from substrate.pty.session import Session


def make(idle: float = 100.0) -> Session:
    return Session(
        id="t-0123456789abcdef",
        workspace="w",
        profile="interactive",
        grant="g-0000000000000000",
        cols=80,
        rows=24,
        now=0.0,
        idle_timeout_s=idle,
        ring_capacity=64,
    )


def test_one_controller_many_observers() -> None:
    s = make()
    s.attach(1, "control", "g", 1.0)
    s.attach(2, "observe", "g", 1.0)
    s.attach(3, "observe", "g", 1.0)
    with pytest.raises(ControllerBusy):
        s.attach(4, "control", "g", 1.0)
    assert s.controller == 1
    assert 4 not in s.attached


def test_controller_slot_frees_on_detach() -> None:
    s = make()
    s.attach(1, "control", "g", 1.0)
    s.detach(1, 2.0)
    s.attach(2, "control", "g", 3.0)
    assert s.controller == 2
    assert s.state == "running"


def test_observer_cannot_type() -> None:
    s = make()
    s.attach(1, "control", "g", 0.0)
    s.attach(2, "observe", "g", 0.0)
    s.check_input(1, 1.0)
    with pytest.raises(Unauthorized):
        s.check_input(2, 1.0)
    with pytest.raises(Unauthorized):
        s.check_input(99, 1.0)


def test_resize_follows_controller_only() -> None:
    s = make()
    s.attach(1, "control", "g", 0.0)
    s.attach(2, "observe", "g", 0.0)
    assert not s.resize(2, 200, 50)
    assert (s.cols, s.rows) == (80, 24)
    assert s.resize(1, 100, 30)
    assert (s.cols, s.rows) == (100, 30)
    assert not s.resize(1, 100, 30)


def test_close_by_controller_ends_observer_only_detaches() -> None:
    s = make()
    s.attach(1, "control", "g", 0.0)
    s.attach(2, "observe", "g", 0.0)
    assert not s.close_by(2, 1.0)
    assert 2 not in s.attached
    assert s.close_by(1, 1.0)


def test_idle_timeout_counts_from_last_activity() -> None:
    s = make(idle=10.0)
    assert not s.is_idle(9.9)
    s.output(b"x", 5.0)
    assert not s.is_idle(14.9)
    assert s.is_idle(15.0)
    s.attach(1, "control", "g", 20.0)
    assert s.idle_deadline() == 30.0
    s.check_input(1, 25.0)
    assert s.idle_deadline() == 35.0


def test_end_is_idempotent_and_first_reason_wins() -> None:
    s = make()
    s.end("exit", 0)
    s.end("idle", None)
    assert (s.state, s.end_reason, s.exit_code) == ("ended", "exit", 0)
    assert not s.is_idle(1e9)
    with pytest.raises(ValueError):
        s.attach(1, "observe", "g", 0.0)


def test_output_goes_into_bounded_ring() -> None:
    s = make()
    s.output(b"a" * 100, 1.0)
    assert (s.ring.start, s.ring.end) == (36, 100)
