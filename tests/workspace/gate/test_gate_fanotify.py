"""The fanotify attribution source on the real kernel, and its relay's parser.

The "sandbox" is a shell in a pid namespace of its own (`unshare --pid --fork`), as a
container's processes are; the test process plays the host. Needs root (fanotify with
`FAN_MARK_FILESYSTEM`, `setns`), as the daemon does.
"""

from __future__ import annotations

import os
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.workspace.gate import FanotifyAttribution, Unavailable
from substrate.workspace.gate import relay as relay_mod
from substrate.workspace.gate.attribution import handle_at, key
from tests.harness import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="fanotify needs root, as the daemon")


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A shell in a new pid namespace that writes `.env` (in a subshell that exits at
    once) when a line arrives on its stdin, says `done`, and waits for EOF."""
    proc = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "sh",
            "-c",
            'read go; (echo TOKEN=x > "$1/.env"); echo done; read end',
            "sh",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        inner = ""
        deadline = time.monotonic() + 10  # within milliseconds, unless the host is busy
        while not inner and time.monotonic() < deadline:
            inner = children.read_text().strip()
            if not inner:
                time.sleep(0.001)
        assert inner, "unshare never forked"
        yield proc, int(inner.split()[0])
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes its pipes


def test_a_writer_in_the_sandbox_is_attributed_even_after_it_exited(
    tmp_path: Path, sandbox: tuple[subprocess.Popen[bytes], int]
) -> None:
    proc, inner = sandbox
    assert proc.stdin is not None and proc.stdout is not None
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        watch = FanotifyAttribution().watch(root, inner)
        try:
            (tmp_path / "poetry.lock").write_text("the host's\n")
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == b"done\n"  # its writer has exited and been reaped
            touches = watch.touches()
        finally:
            watch.close()
        here = handle_at(root)
    finally:
        os.close(root)
    assert here is not None and touches.lost is None
    assert touches.verdict([key(here, ".env")]) == ("sandbox", None)
    assert touches.verdict([key(here, "poetry.lock")]) == ("unattributed", "changed outside")
    assert key(here, "poetry.lock") not in touches.sandbox


def test_one_relay_serves_each_window_of_a_sandbox_and_ends_with_it(tmp_path: Path) -> None:
    # A shell in its own pid namespace that writes the file named by each line it reads.
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "sh", "-c",
         'while read f; do (echo x > "$1/$f"); echo done; done', "sh", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    attribution = FanotifyAttribution()

    def sandbox_writes(name: str) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(name.encode() + b"\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"done\n"

    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        inner = wait_until(lambda: _child_of(proc.pid))
        first = attribution.watch(root, inner)
        sandbox_writes("a.txt")
        one = first.touches()
        first.close()
        (relay,) = attribution._relays.values()
        (tmp_path / "b.txt").write_text("between windows: no mark, no event\n")
        second = attribution.watch(root, inner)
        assert list(attribution._relays.values()) == [relay]  # the same relay, still running
        sandbox_writes("a.txt")  # the same key again: relayed again in the new window
        (tmp_path / "c.txt").write_text("the host's\n")
        two = second.touches()
        second.close()
        here = handle_at(root)
    finally:
        os.close(root)
        proc.kill()
        proc.communicate()
    assert here is not None and one.lost is None and two.lost is None
    assert key(here, "a.txt") in one.sandbox and key(here, "a.txt") in two.sandbox
    assert key(here, "b.txt") not in two.others | two.sandbox
    assert two.verdict([key(here, "c.txt")]) == ("unattributed", "changed outside")
    # The sandbox's end (its pid namespace's) ends the relay, and the daemon forgets it.
    wait_until(lambda: not attribution._relays)
    assert relay.ended


def _child_of(pid: int) -> int | None:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0]) if children else None


def test_a_sandbox_sharing_the_daemons_pid_namespace_is_refused(tmp_path: Path) -> None:
    # Read from our own namespace every writer has a pid: nothing could be told apart.
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(Unavailable, match="shares the daemon's pid namespace"):
            FanotifyAttribution().watch(root, os.getpid())
        with pytest.raises(Unavailable, match="no sandbox"):
            FanotifyAttribution().watch(root, None)
    finally:
        os.close(root)


def _event(mask: int, pid: int, handle: bytes, name: bytes) -> bytes:
    body = b"F" * 8 + struct.pack("=Ii", len(handle), 1) + handle + name + b"\0"
    body += b"\0" * (-(len(body) + 4) % 4)
    info = struct.pack("=BBH", 2, 0, 4 + len(body)) + body
    return struct.pack("=IBBHQii", 24 + len(info), 3, 0, 24, mask, -1, pid) + info


def test_the_relay_parses_dedups_and_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    out: list[bytes] = []
    relay = relay_mod.Relay(out.append)
    a = _event(0x100, 8, b"HANDLE01", b".env")
    host = _event(0x2, 0, b"HANDLE01", b"poetry.lock")
    unnamed = struct.pack("=IBBHQii", 24, 3, 0, 24, 0x4, -1, 8)  # no DFID_NAME: skipped
    relay.feed(a + a + host + unnamed)
    expected_key = struct.pack("<i", 1) + b"HANDLE01\0"
    assert out == [
        b"S"
        + struct.pack("<H", len(expected_key) + 4)
        + expected_key
        + b".env"
        + b"H"
        + struct.pack("<H", len(expected_key) + 11)
        + expected_key
        + b"poetry.lock"
    ]
    out.clear()
    relay.feed(struct.pack("=IBBHQii", 24, 3, 0, 24, relay_mod.FAN_Q_OVERFLOW, -1, 0))
    assert out == [b"O\0\0"]
    monkeypatch.setattr(relay_mod, "MAX_KEYS", 1)
    out.clear()
    relay.feed(_event(0x2, 0, b"HANDLE02", b"x"))
    assert out == [b"O\0\0"]  # more host keys than kept: no longer complete
