"""Which gVisor sandboxes may still get a stream supervisor (`stream_supervisors.fresh`).

Its secret travels on a stdin that sandboxed code can read: a stream starts only while
no code of the sandbox's has run there (docs/fast-exec.md "Under gVisor")."""

from __future__ import annotations

from dataclasses import dataclass

from substrate.sandbox.supervisor.stream_supervisors import fresh


@dataclass
class FakeSandbox:
    """The counting of `sandboxes.Sandbox.acquire`, with the fields `fresh` reads."""

    id: str = "c"
    workspace: str = "ws"
    acquired: int = 0
    command_users: int = 0
    code_started: bool = False

    def acquire(self, *, command: bool = False) -> None:
        self.acquired += 1
        self.command_users += command


def test_concurrent_first_commands_leave_it_fresh() -> None:
    sandbox = FakeSandbox()
    sandbox.acquire(command=True)
    sandbox.acquire(command=True)
    assert fresh(sandbox)  # type: ignore[arg-type]


def test_a_started_command_ends_it() -> None:
    sandbox = FakeSandbox()
    sandbox.acquire(command=True)
    sandbox.code_started = True
    sandbox.acquire(command=True)
    assert not fresh(sandbox)  # type: ignore[arg-type]


def test_a_terminal_ends_it() -> None:
    sandbox = FakeSandbox()
    sandbox.acquire()  # a terminal's shell: its code runs at once
    sandbox.acquire(command=True)
    assert not fresh(sandbox)  # type: ignore[arg-type]
