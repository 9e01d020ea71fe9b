"""`substrate grant terminal` and `substrate attach` use the daemon's real terminal address.

The test daemons listen on `127.0.0.1:0` (a free port): any client that assumed 7681
would print, or send a token to, the wrong place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from substrate.cli import main as cli
from substrate.pty import attach

if TYPE_CHECKING:
    from tests.harness import DaemonProcess


def listen_of(d: DaemonProcess) -> str:
    with d.client() as c:
        listen: str = c.call("daemon.status")["listen"]
    return listen


def test_grant_terminal_prints_the_daemon_address(
    module_daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    listen = listen_of(module_daemon)
    assert not listen.endswith(":7681")
    ws = module_daemon.make_workspace()
    code = cli.main(
        ["--state-dir", str(module_daemon.state_dir), "grant", "terminal", "--workspace", str(ws)]
    )
    out = capsys.readouterr().out
    assert code == 0
    token = next(line.split()[1] for line in out.splitlines() if line.startswith("token "))
    assert f"page    http://{listen}/#token={token}" in out
    assert f"--url ws://{listen}/pty" in out
    assert "7681" not in out


def test_attach_asks_the_daemon_for_its_url(
    module_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[Any] = []

    def fake_attach(token: str, url: str, session: str | None, mode: str) -> int:
        used.append((token, url, session, mode))
        return 0

    monkeypatch.setattr(attach, "attach", fake_attach)
    monkeypatch.setenv("SUBSTRATE_TOKEN", "g-0.secret")
    state = str(module_daemon.state_dir)
    assert cli.main(["--state-dir", state, "attach", "--observe"]) == 0
    assert used == [("g-0.secret", f"ws://{listen_of(module_daemon)}/pty", None, "observe")]
    # An explicit --url wins.
    assert cli.main(["--state-dir", state, "attach", "--url", "ws://127.0.0.1:1/pty"]) == 0
    assert used[-1][1] == "ws://127.0.0.1:1/pty"


def test_attach_without_a_daemon_refuses_to_guess(
    daemon_factory: Callable[..., DaemonProcess],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def must_not_attach(*args: Any) -> int:
        raise AssertionError("attached to a guessed URL")

    monkeypatch.setattr(attach, "attach", must_not_attach)
    d = daemon_factory(start=False)  # a state dir with no daemon behind it
    code = attach.main(["--token", "g-0.secret", "--state-dir", str(d.state_dir)])
    assert code == attach.EXIT_REFUSED
    assert "give --url" in capsys.readouterr().err


def test_no_listen_when_terminals_could_not_bind(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    busy = daemon_factory()
    d = daemon_factory(listen=listen_of(busy))  # that port is taken
    with d.client() as c:
        assert "listen" not in c.call("daemon.status")
    with pytest.raises(attach.NoTerminalUrl):
        attach.daemon_terminal_url(d.state_dir)
