"""`ConnectionState`, `Admission` and `call_refusal`: a connection's rules, without a socket.

Times are plain numbers (a fake clock): every deadline is checked exactly. The same rules
over a real socket are in tests/protocol/test_server.py (slow-loris, idle timeout, caps).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from substrate.config import Config
from substrate.errors import LimitExceeded, RequestTooLarge, Unauthorized
from substrate.protocol.connection import Admission, ConnectionState, UnsentBytes, call_refusal
from substrate.schema import METHODS
from tests.harness import PACKAGE_ROOT

ROOT = PACKAGE_ROOT
LINE_S = 10.0
IDLE_S = 600.0


def state(now: float = 0.0, **config: object) -> ConnectionState:
    settings = {"line_timeout_s": LINE_S, "idle_timeout_s": IDLE_S, **config}
    return ConnectionState(Config(state_dir="/nonexistent", **settings), now)  # type: ignore[arg-type]


# -- the line deadline (slow-loris) -------------------------------------------------------------


def test_a_started_line_must_end_within_the_line_timeout() -> None:
    conn = state()
    assert conn.received(b'{"jsonrpc":', now=1.0) == []
    assert conn.deadline(1.0, held=False) == 1.0 + LINE_S
    # More bytes of the same line do not move its deadline: a drip is cut off.
    assert conn.received(b'"2.0"', now=9.0) == []
    assert conn.deadline(9.0, held=False) == 1.0 + LINE_S
    assert not conn.expired(1.0 + LINE_S - 0.001, held=False)
    assert conn.expired(1.0 + LINE_S, held=False)


def test_time_the_daemon_does_not_read_is_not_held_against_a_pending_line() -> None:
    conn = state()
    conn.received(b'{"jsonrpc":', now=1.0)
    conn.pause(2.0)  # e.g. max_in_flight reached while dispatching that chunk's lines
    conn.resume(2.0 + 5 * LINE_S)
    assert conn.deadline(2.0 + 5 * LINE_S, held=False) == 1.0 + 6 * LINE_S
    assert not conn.expired(2.0 + 5 * LINE_S, held=False)
    assert conn.expired(1.0 + 6 * LINE_S, held=False)


def test_the_idle_clock_pauses_too_and_restarts_after_a_call_finished_meanwhile() -> None:
    conn = state()
    conn.received(b"{}\n", now=1.0)
    conn.pause(3.0)
    conn.resume(3.0 + IDLE_S)
    assert conn.deadline(3.0 + IDLE_S, held=False) == 1.0 + 2 * IDLE_S
    conn.call_started()
    conn.pause(10.0 + IDLE_S)
    conn.call_finished(20.0 + IDLE_S)
    conn.resume(30.0 + IDLE_S)
    assert conn.deadline(30.0 + IDLE_S, held=False) == 30.0 + 2 * IDLE_S


def test_unsent_bytes_over_either_budget() -> None:
    unsent = UnsentBytes(
        Config(state_dir="/nonexistent", max_unsent_bytes=10, max_unsent_bytes_per_uid=25)
    )
    assert not unsent.over(1000, 9)
    assert unsent.over(1000, 10)
    unsent.add(1000, 25)
    assert unsent.over(1000, 0) and not unsent.over(1001, 0)
    unsent.remove(1000, 25)
    assert unsent.by_uid == {}


def test_a_line_that_ends_clears_its_deadline() -> None:
    conn = state()
    conn.received(b"{}", now=1.0)
    assert conn.received(b"\n", now=2.0) == [b"{}"]
    assert conn.line_started is None
    assert conn.deadline(2.0, held=False) == 2.0 + IDLE_S


def test_a_new_line_begun_in_a_chunk_gets_its_own_deadline() -> None:
    """A client streaming many requests in chunks that split lines is never cut off."""
    conn = state()
    conn.received(b'{"a":1', now=0.0)
    for step in range(1, 6):
        now = step * (LINE_S - 1)  # each chunk ends one line and begins the next
        assert conn.received(b'}\n{"a":1', now=now) == [b'{"a":1}']
        assert conn.deadline(now, held=False) == now + LINE_S
        assert not conn.expired(now + LINE_S - 1, held=False)


def test_a_line_over_the_cap_is_refused_before_it_is_buffered() -> None:
    conn = state(max_request_bytes=1024)
    conn.received(b"x" * 1000, now=0.0)
    with pytest.raises(RequestTooLarge):
        conn.received(b"x" * 25, now=0.0)


# -- idle, calls in flight, subscriptions -------------------------------------------------------


def test_an_idle_connection_expires_idle_timeout_after_its_last_bytes() -> None:
    conn = state(now=5.0)
    assert conn.deadline(5.0, held=False) == 5.0 + IDLE_S
    conn.received(b"{}\n", now=7.0)
    assert conn.deadline(7.0, held=False) == 7.0 + IDLE_S
    assert not conn.expired(7.0 + IDLE_S - 0.001, held=False)
    assert conn.expired(7.0 + IDLE_S, held=False)


def test_a_call_in_flight_is_not_idle_and_idle_counts_from_its_end() -> None:
    conn = state()
    conn.received(b"{}\n", now=1.0)
    conn.call_started()
    assert conn.deadline(1.0, held=False) == math.inf
    assert not conn.expired(1.0 + 10 * IDLE_S, held=False)
    conn.call_finished(now=2000.0)
    assert conn.in_flight == 0
    assert conn.deadline(2000.0, held=False) == 2000.0 + IDLE_S
    assert not conn.expired(2000.0 + IDLE_S - 1, held=False)
    assert conn.expired(2000.0 + IDLE_S, held=False)


def test_a_pending_line_keeps_its_deadline_while_a_call_runs() -> None:
    conn = state()
    conn.received(b"{}\n{", now=1.0)
    conn.call_started()
    assert conn.deadline(1.0, held=False) == 1.0 + LINE_S
    assert conn.expired(1.0 + LINE_S, held=False)


def test_subscriptions_hold_the_connection_and_it_looks_again() -> None:
    conn = state()
    # Held: the wait is only a look again (subscriptions end without telling the state).
    assert conn.deadline(100.0, held=True) == 100.0 + IDLE_S
    assert not conn.expired(100.0 + IDLE_S, held=True)
    # Once nothing holds it, idleness counts from the last activity.
    assert conn.expired(100.0 + IDLE_S, held=False)


# -- end of input ---------------------------------------------------------------------------


def test_end_of_input_ends_the_last_line_and_drains() -> None:
    conn = state()
    conn.received(b'{"a":1}\n{"b":2}', now=1.0)
    assert conn.end_of_input() == [b'{"b":2}']
    assert conn.line_started is None
    conn.call_started()
    assert not conn.drained(held=False)
    conn.call_finished(now=2.0)
    assert not conn.drained(held=True)  # a subscription still sends
    assert conn.drained(held=False)


def test_not_drained_before_end_of_input() -> None:
    assert not state().drained(held=False)


# -- admission: allowed uids, per-socket and per-uid caps --------------------------------------


def admission(**config: object) -> Admission:
    return Admission(Config(state_dir="/nonexistent", **config))  # type: ignore[arg-type]


def test_a_uid_not_allowed_is_refused_and_not_counted() -> None:
    gate = admission(allowed_uids=[1000])
    assert isinstance(gate.admit(4242), Unauthorized)
    assert gate.count == 0
    assert gate.admit(1000) is None


def test_caps_per_socket_and_per_uid() -> None:
    gate = admission(allowed_uids=[1000, 1001], max_connections=3, max_connections_per_uid=2)
    assert gate.admit(1000) is None
    assert gate.admit(1000) is None
    refused = gate.admit(1000)
    assert isinstance(refused, LimitExceeded)
    assert refused.data == {"limit": 2, "scope": "uid"}
    assert gate.admit(1001) is None  # another uid still has room
    refused = gate.admit(1001)
    assert isinstance(refused, LimitExceeded)
    assert refused.data == {"limit": 3, "scope": "socket"}
    gate.release(1000)
    assert gate.admit(1001) is None
    assert gate.by_uid == {1000: 1, 1001: 2}
    for uid in (1000, 1001, 1001):
        gate.release(uid)
    assert (gate.count, gate.by_uid) == (0, {})


def test_operator_methods_are_refused_on_the_agent_socket() -> None:
    grant = METHODS["approval.grant"]
    refused = call_refusal(grant, "agent")
    assert isinstance(refused, Unauthorized)
    assert call_refusal(grant, "operator") is None
    assert call_refusal(METHODS["fs.read"], "agent") is None


# -- layering ------------------------------------------------------------------------------------


def test_the_server_imports_no_handler_and_no_daemon() -> None:
    """The protocol layer is below the handlers: it is given a dispatcher, it imports none."""
    probe = (
        "import sys, substrate.protocol.server\n"
        "up = sorted(m for m in sys.modules if m.split('.')[:2] in"
        " (['substrate', 'api'], ['substrate', 'daemon'], ['substrate', 'cli']))\n"
        "print(up)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"
