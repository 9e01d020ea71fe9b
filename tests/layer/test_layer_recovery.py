"""substrate.layer.recovery: a set a crash left half-applied is applied whole at
start, a generation that never concluded is dropped whole; both journaled."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from substrate.config import Config
from substrate.layer import recovery as layer_recovery
from substrate.layer.changes import Changesets, apply, scan
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.registry import WorkspaceRegistry
from substrate.workspace.writes import Writer, batch_files

ACTOR = "agent:0"
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass
class Env:
    root: Path
    state: Path
    registry: WorkspaceRegistry
    writer: Writer
    journal: Journal
    changesets: Changesets


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    root = make_workspace("demo", {"a.txt": "a\n", "b.txt": "b\n"})
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    registry = WorkspaceRegistry(config, store, journal, state)
    registry.adopt(str(root), None, Policy(), ACTOR)
    try:
        yield Env(
            root, state, registry, Writer(store, journal), journal, Changesets(store, journal)
        )
    finally:
        registry.close()
        store.close()


def _generation(env: Env, sandbox: str, gen: int, files: dict[str, str]) -> tuple[str, str]:
    sandbox_dir = env.state / "layers" / sandbox
    upper, work = sandbox_dir / "upper" / str(gen), sandbox_dir / "work" / str(gen)
    upper.mkdir(parents=True)
    work.mkdir(parents=True)
    for name, text in files.items():
        (upper / name).write_text(text)
    return str(upper), str(work)


def _recovered(env: Env) -> list[dict[str, object]]:
    return [
        msgspec.to_builtins(e.data)
        for e in env.journal.read(limit=1000)
        if e.kind == "changes.recovered"
    ]


def test_a_half_applied_set_is_applied_whole_at_start(env: Env) -> None:
    ws = env.registry.all()[0]
    upper, work = _generation(env, "s1", 4, {"a.txt": "A\n", "b.txt": "B\n", "c.txt": "C\n"})
    ufd = os.open(upper, DIR)
    try:
        changeset = scan(ufd, ws.root_fd)
        cs_id = env.changesets.record(ws, 4, upper, work, changeset, "applying")
        # The daemon dies after the first change landed.
        first = msgspec.structs.replace(changeset, changes=changeset.changes[:1])
        apply(env.writer, ws, ufd, first, ACTOR)
    finally:
        os.close(ufd)
    assert sorted(c.path for c in changeset.changes) == ["a.txt", "b.txt", "c.txt"]
    assert (env.root / "a.txt").read_text() == "A\n" and (env.root / "b.txt").read_text() == "b\n"

    assert layer_recovery.finish_applying(env.changesets, env.writer, env.registry.get) == 1

    assert [(env.root / n).read_text() for n in ("a.txt", "b.txt", "c.txt")] == [
        "A\n",
        "B\n",
        "C\n",
    ]
    assert env.changesets.get(cs_id).state == "applied"
    [entry] = _recovered(env)
    assert entry["changeset"] == cs_id and entry["outcome"] == "applied"
    assert (entry["applied"], entry["unchanged"], entry["conflicts"]) == (2, 1, 0)
    # Nothing left to finish: a second start does nothing.
    assert layer_recovery.finish_applying(env.changesets, env.writer, env.registry.get) == 0


def test_a_host_edit_since_the_crash_is_a_conflict_not_overwritten(env: Env) -> None:
    ws = env.registry.all()[0]
    upper, work = _generation(env, "s1", 0, {"a.txt": "A\n", "b.txt": "B\n"})
    ufd = os.open(upper, DIR)
    try:
        cs_id = env.changesets.record(ws, 0, upper, work, scan(ufd, ws.root_fd), "applying")
    finally:
        os.close(ufd)
    (env.root / "b.txt").write_text("host\n")

    layer_recovery.finish_applying(env.changesets, env.writer, env.registry.get)

    assert (env.root / "a.txt").read_text() == "A\n"
    assert (env.root / "b.txt").read_text() == "host\n"
    [entry] = _recovered(env)
    assert entry["changeset"] == cs_id and entry["conflicts"] == 1


def test_a_generation_that_never_concluded_is_dropped_whole(env: Env) -> None:
    ws = env.registry.all()[0]
    killed, _ = _generation(env, "s1", 2, {"new.txt": "n\n", "a.txt": "A\n"})
    idle, idle_work = _generation(env, "s1", 3, {})
    kept_upper, kept_work = _generation(env, "s2", 0, {"k.txt": "k\n"})
    ufd = os.open(kept_upper, DIR)
    try:
        env.changesets.record(ws, 0, kept_upper, kept_work, scan(ufd, ws.root_fd), "pending")
    finally:
        os.close(ufd)
    dirs = layer_recovery.sandbox_dirs(str(env.state))
    assert [os.path.basename(d) for d in dirs] == ["s1", "s2"]

    dropped = layer_recovery.drop_unconcluded(env.changesets, env.journal, dirs)

    assert [(os.path.basename(d), g) for d, g in dropped] == [("s1", 2)]
    assert not os.path.exists(killed) and not os.path.exists(idle)
    assert not os.path.exists(idle_work)
    assert os.path.exists(kept_upper)  # a concluded (kept) set's layer stays
    assert not (env.root / "new.txt").exists() and (env.root / "a.txt").read_text() == "a\n"
    assert _recovered(env) == [{"layer": "s1", "generation": 2, "outcome": "dropped"}]


# --- a crash inside a batch: landed, not journaled ------------------------------------------


def _restart(env: Env, adopt_root: Path) -> Env:
    """What a restart opens: the same state database, a new run (epoch)."""
    env.registry.close()
    env.journal.store.close()
    store = Store(env.state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(env.state), adopt_roots=[str(adopt_root)])
    registry = WorkspaceRegistry(config, store, journal, env.state)
    return Env(
        env.root,
        env.state,
        registry,
        Writer(store, journal),
        journal,
        Changesets(store, journal),
    )


def _die_after_renames(env: Env, upper: str, work: str, renames: int) -> None:
    """In a child process: record the set `applying`, apply it, and die (`_exit`, no
    cleanup) at the rename after `renames` renames - as `kill -9` would."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            ws = env.registry.all()[0]
            done = [0]

            def dying(real: Callable[..., None]) -> Callable[..., None]:
                def rename(*args: Any, **kw: Any) -> None:
                    if done[0] == renames:
                        os._exit(9)
                    done[0] += 1
                    real(*args, **kw)

                return rename

            os.rename = dying(os.rename)  # type: ignore[assignment]
            batch_files.rename_new = dying(batch_files.rename_new)  # type: ignore[assignment]
            ufd = os.open(upper, DIR)
            changeset = scan(ufd, ws.root_fd)
            env.changesets.record(ws, 7, upper, work, changeset, "applying")
            apply(env.writer, ws, ufd, changeset, ACTOR)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9


def test_a_crash_between_renames_and_journal_is_journaled_at_start(
    env: Env, adopt_root: Path
) -> None:
    upper, work = _generation(env, "s1", 7, {"a.txt": "A\n", "b.txt": "B\n", "c.txt": "C\n"})
    os.mkdir(os.path.join(upper, "d"))  # a directory step, journaled before the files

    _die_after_renames(env, upper, work, renames=2)

    # a.txt and b.txt landed, c.txt did not; the journal has only the directory.
    assert [(env.root / n).read_text() for n in ("a.txt", "b.txt")] == ["A\n", "B\n"]
    assert not (env.root / "c.txt").exists()
    kinds = [(e.kind, e.data.get("path")) for e in env.journal.read(limit=100)]
    assert ("changes.apply_dir", "demo:d") in kinds
    assert not any(kind == "changes.apply" for kind, _ in kinds)

    env = _restart(env, adopt_root)
    ws = env.registry.all()[0]
    assert layer_recovery.finish_applying(env.changesets, env.writer, env.registry.get) == 1

    assert [(env.root / n).read_text() for n in ("a.txt", "b.txt", "c.txt")] == [
        "A\n",
        "B\n",
        "C\n",
    ]
    applies = [e for e in env.journal.read(limit=100) if e.kind == "changes.apply"]
    # Each file journaled exactly once: the two that landed before the crash as
    # recovered (with the actor of the command), the third by the re-apply.
    assert [(e.data["path"], e.data.get("recovered"), e.actor) for e in applies] == [
        ("demo:a.txt", True, ACTOR),
        ("demo:b.txt", True, ACTOR),
        ("demo:c.txt", None, "daemon"),
    ]
    assert applies[0].data["new_sha256"] == hashlib.sha256(b"A\n").hexdigest()
    [entry] = _recovered(env)
    assert (entry["applied"], entry["unchanged"], entry["conflicts"]) == (1, 3, 0)
    assert env.journal.verify() is None
    assert env.journal.store.query("SELECT COUNT(*) AS n FROM write_intents")[0]["n"] == 0
    # The crashed run's temp file of c.txt (recorded, never renamed) goes at the start.
    assert env.registry.clean_stale_temp_files() == 1
    assert [p for p in os.listdir(env.root) if p.startswith(".substrate-tmp-")] == []
    assert ws.id == env.registry.all()[0].id


def test_a_landed_change_edited_by_the_host_since_is_not_claimed(
    env: Env, adopt_root: Path
) -> None:
    upper, work = _generation(env, "s1", 7, {"a.txt": "A\n", "b.txt": "B\n"})
    _die_after_renames(env, upper, work, renames=1)
    assert (env.root / "a.txt").read_text() == "A\n"
    (env.root / "a.txt").write_text("host\n")  # before the restart

    env = _restart(env, adopt_root)
    layer_recovery.finish_applying(env.changesets, env.writer, env.registry.get)

    assert (env.root / "a.txt").read_text() == "host\n"
    assert (env.root / "b.txt").read_text() == "B\n"
    applies = [e.data for e in env.journal.read(limit=100) if e.kind == "changes.apply"]
    assert [(d["path"], d.get("recovered")) for d in applies] == [("demo:b.txt", None)]
    [entry] = _recovered(env)
    assert (entry["applied"], entry["conflicts"]) == (1, 1)
    assert env.journal.store.query("SELECT COUNT(*) AS n FROM write_intents")[0]["n"] == 0
