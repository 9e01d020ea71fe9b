"""The rw gate reverts only what it can attribute to the sandbox (docs/protocol.md §11).

With a fake attribution source: the test says who touched each entry, as the kernel
would (a key per directory entry: its directory's handle and its name). The real source
is tested in test_gate_fanotify.py, and against the engine in
tests/integration/test_gate_engine.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from substrate.config import Config
from substrate.schema.proc import PolicyBlocked
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.gate import SnapshotGate, Touches
from substrate.workspace.gate.attribution import Key, handle_at, key
from substrate.workspace.registry import Workspace, WorkspaceRegistry

LOCK = b"# poetry lock\n"
DENY = ["*.lock", ".env", "secrets/*.pem"]


@dataclass
class FakeWatch:
    sandbox: set[Key] = field(default_factory=set)
    others: set[Key] = field(default_factory=set)
    lost: str | None = None
    closed: bool = False

    def touches(self) -> Touches:
        return Touches(frozenset(self.sandbox), frozenset(self.others), self.lost)

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeAttribution:
    watches: list[FakeWatch] = field(default_factory=list)
    pids: list[int | None] = field(default_factory=list)

    def watch(self, root_fd: int, sandbox_pid: int | None) -> FakeWatch:
        self.watches.append(FakeWatch())
        self.pids.append(sandbox_pid)
        return self.watches[-1]


@dataclass
class Env:
    root: Path
    ws: Workspace
    gate: SnapshotGate
    source: FakeAttribution
    journal: Journal

    def saw(self, rel: str, *, sandbox: bool) -> None:
        """Record that the sandbox (or someone else) touched `rel`: the key the kernel
        reports, taken while its directory exists."""
        parent, _, name = rel.rpartition("/")
        fd = os.open(self.root / parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            found = handle_at(fd)
        finally:
            os.close(fd)
        assert found is not None
        watch = self.source.watches[-1]
        (watch.sandbox if sandbox else watch.others).add(key(found, name))

    def entries(self) -> dict[str, dict[str, object]]:
        return {
            str(e.data["path"]): e.data
            for e in self.journal.read(limit=1000)
            if e.kind == "policy.blocked"
        }


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    root = make_workspace(
        "attr", {"poetry.lock": LOCK, "src/main.py": "print(1)\n", "secrets/k.pem": "KEY\n"}
    )
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    registry = WorkspaceRegistry(
        Config(state_dir=str(state), adopt_roots=[str(adopt_root)]), store, journal, state
    )
    ws = registry.adopt(str(root), None, Policy(write_deny=DENY), "test")
    source = FakeAttribution()
    try:
        yield Env(
            root, ws, SnapshotGate(state / "gate", journal, attribution=source), source, journal
        )
    finally:
        registry.close()
        store.close()


def outcome(blocked: list[PolicyBlocked]) -> list[tuple[str, str, bool, str | None]]:
    return sorted((b.path, b.change, b.reverted, b.reason) for b in blocked)


async def test_the_sandboxs_change_is_reverted_a_host_edit_is_kept(env: Env) -> None:
    ticket = await env.gate.before(env.ws, sandbox_pid=4242)
    assert env.source.pids == [4242]
    (env.root / ".env").write_text("TOKEN=x\n")
    env.saw(".env", sandbox=True)
    (env.root / "poetry.lock").write_bytes(b"the person's lock\n")
    env.saw("poetry.lock", sandbox=False)
    (env.root / "host.lock").write_bytes(b"new\n")
    env.saw("host.lock", sandbox=False)
    blocked = await env.gate.after(env.ws, ticket)
    assert outcome(blocked) == [
        ("attr:.env", "create", True, None),
        ("attr:host.lock", "create", False, "unattributed"),
        ("attr:poetry.lock", "modify", False, "unattributed"),
    ]
    assert not (env.root / ".env").exists()
    assert (env.root / "poetry.lock").read_bytes() == b"the person's lock\n"
    assert (env.root / "host.lock").read_bytes() == b"new\n"
    entries = env.entries()
    assert entries["attr:poetry.lock"]["reverted"] is False
    assert entries["attr:poetry.lock"]["reason"] == "unattributed"
    assert entries["attr:poetry.lock"]["attribution"] == "changed outside"
    assert "reason" not in entries["attr:.env"]


async def test_a_change_nobody_was_seen_making_is_kept(env: Env) -> None:
    ticket = await env.gate.before(env.ws, sandbox_pid=1)
    (env.root / "poetry.lock").write_bytes(b"who?\n")  # no event: e.g. another sandbox
    blocked = await env.gate.after(env.ws, ticket)
    assert outcome(blocked) == [("attr:poetry.lock", "modify", False, "unattributed")]
    assert env.entries()["attr:poetry.lock"]["attribution"] == "not seen from the sandbox"
    assert (env.root / "poetry.lock").read_bytes() == b"who?\n"


async def test_a_file_both_changed_is_kept_as_mixed(env: Env) -> None:
    ticket = await env.gate.before(env.ws, sandbox_pid=1)
    (env.root / "poetry.lock").write_bytes(b"sandbox, then the person\n")
    env.saw("poetry.lock", sandbox=True)
    env.saw("poetry.lock", sandbox=False)
    blocked = await env.gate.after(env.ws, ticket)
    assert outcome(blocked) == [("attr:poetry.lock", "modify", False, "mixed")]
    assert (env.root / "poetry.lock").read_bytes() == b"sandbox, then the person\n"


async def test_lost_events_revert_nothing(env: Env) -> None:
    ticket = await env.gate.before(env.ws, sandbox_pid=1)
    (env.root / ".env").write_text("x\n")
    env.saw(".env", sandbox=True)
    env.source.watches[-1].lost = "events were lost"
    blocked = await env.gate.after(env.ws, ticket)
    assert outcome(blocked) == [("attr:.env", "create", False, "unattributed")]
    assert env.entries()["attr:.env"]["attribution"] == "events were lost"
    assert (env.root / ".env").exists()


async def test_a_denied_file_in_a_directory_the_sandbox_removed_is_restored(env: Env) -> None:
    # `secrets` itself is not denied, so the change is at `secrets/k.pem` whose directory
    # is gone after the command: its handle from the baseline still names it.
    ticket = await env.gate.before(env.ws, sandbox_pid=1)
    env.saw("secrets/k.pem", sandbox=True)  # the unlink, reported on `secrets`
    env.saw("secrets", sandbox=True)
    (env.root / "secrets" / "k.pem").unlink()
    (env.root / "secrets").rmdir()
    blocked = await env.gate.after(env.ws, ticket)
    assert outcome(blocked) == [("attr:secrets/k.pem", "delete", True, None)]
    assert (env.root / "secrets" / "k.pem").read_text() == "KEY\n"


async def test_a_denied_tree_is_reverted_only_if_nothing_else_touched_inside(env: Env) -> None:
    # A created denied dir is one change; a host file inside it makes it not the
    # sandbox's alone.
    ticket = await env.gate.before(env.ws, sandbox_pid=1)
    (env.root / "a.lock").mkdir()
    env.saw("a.lock", sandbox=True)
    (env.root / "a.lock" / "x").write_text("sandbox\n")
    env.saw("a.lock/x", sandbox=True)
    (env.root / "b.lock").mkdir()
    env.saw("b.lock", sandbox=True)
    (env.root / "b.lock" / "mine").write_text("person\n")
    env.saw("b.lock/mine", sandbox=False)
    blocked = await env.gate.after(env.ws, ticket)
    assert outcome(blocked) == [
        ("attr:a.lock", "create", True, None),
        ("attr:b.lock", "create", False, "mixed"),
    ]
    assert not (env.root / "a.lock").exists()
    assert (env.root / "b.lock" / "mine").read_text() == "person\n"


async def test_the_watch_spans_overlapping_commands_and_ends_with_the_last(env: Env) -> None:
    first = await env.gate.before(env.ws, sandbox_pid=7)
    second = await env.gate.before(env.ws, sandbox_pid=8)
    assert env.source.pids == [7]  # one baseline, watched for the sandbox that took it
    (watch,) = env.source.watches
    assert await env.gate.after(env.ws, first) == []
    assert not watch.closed
    assert await env.gate.after(env.ws, second) == []
    assert watch.closed


async def test_without_a_sandbox_process_nothing_is_reverted(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]
) -> None:
    # The daemon's gate (fanotify) told no sandbox: no change is attributable. The old
    # gate reverted this host edit.
    root = make_workspace("plain", {"poetry.lock": LOCK})
    state = tmp_path / "state2"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    registry = WorkspaceRegistry(
        Config(state_dir=str(state), adopt_roots=[str(adopt_root)]), store, journal, state
    )
    try:
        ws = registry.adopt(str(root), None, Policy(write_deny=DENY), "test")
        gate = SnapshotGate(state / "gate", journal)
        ticket = await gate.before(ws)
        (root / "poetry.lock").write_bytes(b"edited on the host\n")
        blocked = await gate.after(ws, ticket)
        assert outcome(blocked) == [("plain:poetry.lock", "modify", False, "unattributed")]
        assert (root / "poetry.lock").read_bytes() == b"edited on the host\n"
    finally:
        registry.close()
        store.close()


def test_verdicts() -> None:
    a, b, c = b"\1\0\0\0h\0a", b"\1\0\0\0h\0b", b"\1\0\0\0h\0c"
    seen = Touches(sandbox=frozenset({a, b}), others=frozenset({b, c}))
    assert seen.verdict([a]) == ("sandbox", None)
    assert seen.verdict([b]) == ("mixed", "changed outside")
    assert seen.verdict([a, c]) == ("mixed", "changed outside")
    assert seen.verdict([c]) == ("unattributed", "changed outside")
    assert seen.verdict([]) == ("unattributed", "not seen from the sandbox")
    assert Touches(sandbox=frozenset({a}), lost="x").verdict([a]) == ("unattributed", "x")
