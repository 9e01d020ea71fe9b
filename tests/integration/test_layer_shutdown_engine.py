"""A daemon stopping while terminals and commands still run on `workspace = "layer"`
sandboxes (docs/working-layer.md, "Shutdown"), in the real engine.

An in-process daemon (test_terminal's profiles and state) is stopped the way a signal
stops it — every service cancelled at once — with a shell open on `term-layer` (an
agent's `proc.start`ed command sharing its generation) and a second `proc.start`ed
command alone on `plain-tiny` (a layer profile too). After the stop nothing is mounted
under the state dir, and the journal and the checkout say what became of every change:
applied at the stop (the terminals end and conclude before their sandboxes go), or —
when they could not end in time — kept as a pending set that the next start does not
drop and `changes.apply` lands.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from test_terminal import dirs, leftovers  # noqa: F401 - fixtures
from trio_websocket import WebSocketConnection

from substrate.daemon import Daemon
from substrate.layer.mounts.overlay import mounted_under
from substrate.process import service
from substrate.protocol.client import AsyncClient, open_client
from substrate.pty import docker as pty_docker
from substrate.pty.client import open_terminal
from substrate.schema.journal import Entry
from tests.harness import wait_until_async
from tests.harness.inprocess import Served, in_process_config, serving_until_stopped
from tests.harness.ws_frames import read_until, recv, send

#: The shell writes this many files (the set's apply then takes a while: long enough that
#: a sweep of the layer directory racing it found the directory busy).
NOTES = 200
SHELL_WRITES = (
    f"trap '' TERM; mkdir notes; i=0; while [ $i -lt {NOTES} ]; do echo n$i > notes/$i.txt; i=$((i+1)); "
    "done; echo do$((1+1))ne\r"
)


@dataclass
class Running:
    daemon: Daemon
    agent: AsyncClient
    operator: AsyncClient
    ws: str
    project: Path
    state: Path
    served: Served

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.daemon.terminals.http.port}/pty"

    async def start(self, profile: str, script: str) -> str:
        started = await self.agent.call(
            "proc.start", workspace=self.ws, profile=profile, argv=["sh", "-c", script]
        )
        proc: str = started["proc"]
        return proc

    async def in_a_layer(self, name: str) -> None:
        """Wait until a generation's upper dir holds `name` (the command wrote it)."""

        async def there() -> bool:
            return bool(list(self.state.glob(f"layers/*/upper/*/{name}")))

        await wait_until_async(there, 60, interval=0.05)

    async def stop_daemon(self) -> None:
        """Stop the daemon as a signal does (every service cancelled at once) and wait."""
        with trio.fail_after(120):
            await self.served.stop()


@contextlib.asynccontextmanager
async def running(made: tuple[Path, Path, Path]) -> AsyncIterator[Running]:
    """A serving daemon on `made` (test_terminal's `dirs`) with `project` adopted; the
    body stops it (`stop_daemon`) and may then read its store, open until the block ends."""
    state, profiles, root = made
    config = in_process_config(state, root, profiles, listen="127.0.0.1:0")
    async with (
        serving_until_stopped(config) as served,
        open_client(state / "substrate.sock") as agent,
        open_client(state / "operator.sock") as operator,
    ):
        ws = (await agent.call("workspace.adopt", path=str(root / "project")))["workspace"]
        yield Running(served.daemon, agent, operator, ws, root / "project", state, served)


async def _shell(r: Running, term: WebSocketConnection) -> tuple[str, str]:
    """Open a `term-layer` shell on `term`, write the notes; (session, grant token)."""
    issued = await r.operator.call(
        "grant.issue", kind="interactive_terminal", workspace=r.ws, profile="term-layer"
    )
    await send(term, type="open", token=issued["token"], cols=80, rows=24)
    opened = await recv(term)
    assert opened["type"] == "opened", opened
    await read_until(term, "$ ", allow_resync=True)
    await send(term, type="input", data=SHELL_WRITES)
    await read_until(term, "do2ne\r\n", allow_resync=True)
    return str(opened["session"]), str(issued["grant"])


def _entries(daemon: Daemon, kind: str) -> list[Entry]:
    return daemon.journal.read(limit=100_000, kinds=[kind])


def _mounts(state: Path) -> list[str]:
    return [m.mount_point for m in mounted_under(str(state))]


def _notes(project: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((project / "notes").glob("*.txt"))}


async def test_a_stop_concludes_open_terminals_and_running_commands(
    dirs: tuple[Path, Path, Path],  # noqa: F811 - fixture
    leftovers: str,  # noqa: F811 - fixture: no container, no mount left
    tiny_image: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")
    async with running(dirs) as r:
        async with open_terminal(r.url) as term:
            session, grant = await _shell(r, term)
            # In a directory of its own: `alone`'s set lands in the root meanwhile, and a
            # create beside another writer's change is a conflict (docs/working-layer.md,
            # "Host edits during a command").
            beside = await r.start(
                "term-layer", "mkdir agent && echo agent > agent/agent.txt; sleep 300"
            )
            alone = await r.start("plain-tiny", "echo alone > alone.txt; sleep 300")
            await r.in_a_layer("agent/agent.txt")
            await r.in_a_layer("alone.txt")
            assert not (r.project / "agent" / "agent.txt").exists()  # in their layers only
            await r.stop_daemon()  # the shell still open, both commands running
        daemon = r.daemon
        assert _mounts(r.state) == []
        # Every change landed at the stop, through the guarded path.
        assert (r.project / "agent" / "agent.txt").read_text() == "agent\n"
        assert (r.project / "alone.txt").read_text() == "alone\n"
        assert _notes(r.project) == {f"{i}.txt": f"n{i}\n" for i in range(NOTES)}
        # The shared generation: one set holding the command's and the shell's changes.
        (shared,) = _entries(daemon, "changes.shared")
        assert (shared.data["procs"], shared.data["sessions"]) == ([beside], [session])
        closed = next(e for e in _entries(daemon, "pty.closed") if e.data["session"] == session)
        assert closed.data["reason"] == "shutdown"
        changes = closed.data["changes"]
        assert "error" not in changes, changes
        exited = {e.data["proc"]: e.data for e in _entries(daemon, "proc.exited")}
        assert exited[beside]["cancelled"] and exited[alone]["cancelled"]
        assert exited[alone]["changes"]["applied"] == 1
        # The shell's set is the last to conclude, or the command's after it: either way
        # the set the journal names is applied whole, with every file of both.
        cs = daemon.execution.changesets.get(shared.data["changeset"])
        assert cs.state == "applied"
        applied = {e.data["path"]: e.actor for e in _entries(daemon, "changes.apply")}
        assert applied["project:alone.txt"] != f"terminal:{grant}"
        assert len([p for p in applied if p.startswith("project:notes/")]) == NOTES
        assert {applied["project:agent/agent.txt"], applied["project:notes/0.txt"]} == {
            shared.actor
        }
        assert _entries(daemon, "changes.stopped") == []  # nothing had to be kept
        assert daemon.journal.verify() is None


async def test_a_stop_keeps_for_review_what_could_not_conclude_in_time(
    dirs: tuple[Path, Path, Path],  # noqa: F811 - fixture
    leftovers: str,  # noqa: F811 - fixture: no container, no mount left
    tiny_image: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")
    # No time for the shell to end before its sandbox goes: its generation (with the
    # command beside it) is kept, never applied half, never dropped.
    monkeypatch.setattr(service, "SHUTDOWN_DRAIN_S", 0.0)
    # And the shell (ignoring TERM) outlives the start of the stop by seconds.
    monkeypatch.setattr(pty_docker, "GRACE_S", 8.0)
    async with running(dirs) as r:
        async with open_terminal(r.url) as term:
            session, _grant = await _shell(r, term)
            beside = await r.start("term-layer", "echo agent > agent.txt; sleep 300")
            await r.in_a_layer("agent.txt")
            await r.stop_daemon()
        daemon = r.daemon
        assert _mounts(r.state) == []
        assert not (r.project / "agent.txt").exists()
        assert not (r.project / "notes").exists()
        (stopped,) = _entries(daemon, "changes.stopped")
        assert stopped.data["mode"] == "apply"  # what they asked; kept as "review"
        assert (stopped.data["procs"], stopped.data["sessions"]) == ([beside], [session])
        changeset = stopped.data["changeset"]
        assert [e.data["changeset"] for e in _entries(daemon, "changes.kept")] == [changeset]
        assert daemon.execution.changesets.get(changeset).state == "pending"
        closed = next(e for e in _entries(daemon, "pty.closed") if e.data["session"] == session)
        assert closed.data["changes"]["error"] == "daemon_stopped"
        assert _entries(daemon, "changes.apply") == []
    # The next start keeps the set (its recovery drops only generations without one);
    # applying it lands every change.
    dropped: list[list[tuple[str, int]]] = []
    drop = service.drop_unconcluded

    def recording(*args: Any) -> list[tuple[str, int]]:
        gone = drop(*args)
        dropped.append(gone)
        return gone

    monkeypatch.setattr(service, "drop_unconcluded", recording)
    async with running(dirs) as again:
        assert again.ws == r.ws

        async def recovered() -> bool:
            return bool(dropped)

        await wait_until_async(recovered, 60, interval=0.05)
        assert dropped == [[]]
        assert _entries(again.daemon, "changes.recovered") == []
        result = await again.agent.call("changes.apply", changeset=changeset)
        assert result["counts"]["applied"] == NOTES + 2  # the notes dir, its files, agent.txt
        assert (again.project / "agent.txt").read_text() == "agent\n"
        assert _notes(again.project) == {f"{i}.txt": f"n{i}\n" for i in range(NOTES)}
        await again.stop_daemon()
    assert _mounts(r.state) == []
