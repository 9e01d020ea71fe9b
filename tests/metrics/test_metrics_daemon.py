"""The metrics page in a real daemon: off by default; an address already taken is logged
and the daemon serves without its page."""

from __future__ import annotations

import socket
from collections.abc import Callable

from tests.harness import DaemonProcess


def test_off_by_default(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        status = c.call("daemon.status")
    assert "metrics_listen" not in status
    off = {"state": "off", "last_seq": 0, "lag_entries": 0, "last_error": None}
    assert status["journal_export"] == off


def test_an_address_taken_is_logged_and_the_daemon_serves_on(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
        with d.client() as c:
            status = c.call("daemon.status")
        assert "metrics_listen" not in status
        assert f"metrics: cannot listen on 127.0.0.1:{port}" in d.stderr()
