"""`substrate attach`: raw mode restored, and the real client driven in tmux (fake PTY)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import termios
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from substrate.pty.attach import raw_terminal
from tests.harness import PACKAGE_ROOT, WaitTimeout, wait_until

ROOT = PACKAGE_ROOT
TMUX = shutil.which("tmux")


def test_raw_mode_is_restored_even_on_error() -> None:
    leader, follower = os.openpty()
    try:
        before = termios.tcgetattr(follower)
        with pytest.raises(RuntimeError), raw_terminal(follower) as is_tty:
            assert is_tty
            assert termios.tcgetattr(follower) != before
            raise RuntimeError("boom")
        assert termios.tcgetattr(follower) == before
    finally:
        os.close(leader)
        os.close(follower)


def test_raw_mode_skips_non_terminals() -> None:
    r, w = os.pipe()
    try:
        with raw_terminal(r) as is_tty:
            assert not is_tty
    finally:
        os.close(r)
        os.close(w)


@pytest.fixture
def server() -> Iterator[dict[str, object]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.harness.pty_fake_server"],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        info: dict[str, object] = json.loads(proc.stdout.readline())
        yield info
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
def tmux() -> Iterator[Callable[..., str]]:
    if TMUX is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    sock = "sbst-" + secrets.token_hex(4)

    def run(*args: str) -> str:
        assert TMUX is not None
        return subprocess.run(
            [TMUX, "-L", sock, "-f", "/dev/null", *args], check=True, capture_output=True, text=True
        ).stdout

    yield run
    subprocess.run([TMUX, "-L", sock, "kill-server"], capture_output=True, check=False)


def wait_for(
    tmux: Callable[..., str], needle: str, timeout: float = 10.0, session: str = "att"
) -> str:
    screen = ""

    def shown() -> bool:
        nonlocal screen
        screen = tmux("capture-pane", "-p", "-t", session)
        return needle in screen

    try:
        wait_until(shown, timeout, interval=0.05)
    except WaitTimeout:
        raise AssertionError(f"{needle!r} not on screen:\n{screen}") from None
    return screen


def exit_status(status_file: Path, timeout: float = 10.0) -> int:
    wait_until(
        lambda: status_file.exists() and status_file.read_text().endswith("\n"),
        timeout,
        interval=0.05,
        message="attach did not exit",
    )
    return int(status_file.read_text())


def start_attach(
    tmux: Callable[..., str], server: dict[str, object], session: str, status_file: Path
) -> None:
    tmux(
        "new-session", "-d", "-s", session, "-x", "100", "-y", "30",
        "-e", f"SUBSTRATE_TOKEN={server['token']}",
        "-e", f"PYTHONPATH={ROOT}",
        "--",
        sys.executable, "-m", "tests.harness.attach_and_report", str(status_file),
        "--url", f"http://127.0.0.1:{server['port']}/",
    )  # fmt: skip
    tmux("set-option", "-t", session, "remain-on-exit", "on")


def test_attach_in_tmux_echo_resize_exit_code(
    tmux: Callable[..., str], server: dict[str, object], tmp_path: Path
) -> None:
    status = tmp_path / "status"
    start_attach(tmux, server, "att", status)
    wait_for(tmux, "$")
    tmux("send-keys", "-t", "att", "echo hi", "Enter")
    wait_for(tmux, "\nhi")
    tmux("resize-window", "-t", "att", "-x", "120", "-y", "40")
    # The resize travels SIGWINCH → attach → WebSocket → PTY: ask until it has arrived.
    for attempt in range(40):
        tmux("send-keys", "-t", "att", "size", "Enter")
        try:
            wait_for(tmux, "40 120", timeout=0.5)
            break
        except AssertionError:
            if attempt == 39:
                raise
    tmux("send-keys", "-t", "att", "exit 7", "Enter")
    assert exit_status(status) == 7


def test_attach_detach_key_and_refusal(
    tmux: Callable[..., str], server: dict[str, object], tmp_path: Path
) -> None:
    start_attach(tmux, server, "att", tmp_path / "detach")
    wait_for(tmux, "$")
    tmux("send-keys", "-t", "att", "C-]")
    assert exit_status(tmp_path / "detach") == 0
    wait_for(tmux, "detached")
    bad = {**server, "token": "g-0000000000000000." + "a" * 43}
    start_attach(tmux, bad, "bad", tmp_path / "bad")
    assert exit_status(tmp_path / "bad") == 1
    wait_for(tmux, "grant_invalid", session="bad")
