"""substrate.workspace.layer.store: change sets kept by id, applied later through the
guarded path (all or some paths, dry run, twice), discarded with their layer."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from substrate.config import Config
from substrate.errors import ChangesetUnknown
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.layer import ChangeSet, Changesets, scan
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from substrate.workspace.writes import Writer

ACTOR = "agent:0"
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass
class Env:
    root: Path
    upper: Path
    work: Path
    ws: Workspace
    writer: Writer
    journal: Journal
    changesets: Changesets

    def keep(self) -> str:
        ufd = os.open(self.upper, DIR)
        try:
            cs: ChangeSet = scan(ufd, self.ws.root_fd)
        finally:
            os.close(ufd)
        return self.changesets.record(self.ws, 3, str(self.upper), str(self.work), cs, "pending")


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    root = make_workspace("demo", {"a.txt": "a\n", "d/x": "x\n", "keep.txt": "k\n"})
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    registry = WorkspaceRegistry(config, store, journal, state)
    ws = registry.adopt(str(root), None, Policy(require_approval=["gated/**"]), ACTOR)
    upper, work = tmp_path / "layers" / "upper" / "3", tmp_path / "layers" / "work" / "3"
    (upper / "d").mkdir(parents=True)
    work.mkdir(parents=True)
    (upper / "a.txt").write_text("A\n")
    (upper / "d" / "x").write_text("X\n")
    (upper / "new.txt").write_text("new\n")
    try:
        yield Env(
            root, upper, work, ws, Writer(store, journal), journal, Changesets(store, journal)
        )
    finally:
        registry.close()
        store.close()


def test_kept_set_is_remembered_and_nothing_lands(env: Env) -> None:
    cs_id = env.keep()
    assert cs_id.startswith("cs_") and len(cs_id) == 19
    kept = env.changesets.get(cs_id)
    assert kept.state == "pending" and kept.workspace == env.ws.id and kept.generation == 3
    assert sorted(c.path for c in kept.changeset.changes) == ["a.txt", "d/x", "new.txt"]
    assert (env.root / "a.txt").read_text() == "a\n"
    assert not (env.root / "new.txt").exists()
    assert [e.kind for e in env.journal.read(limit=100) if e.kind == "changes.kept"] == [
        "changes.kept"
    ]


def test_apply_lands_everything_once(env: Env) -> None:
    cs_id = env.keep()
    kept, result, unmatched = env.changesets.apply(env.writer, env.ws, cs_id, None, False, ACTOR)
    assert kept.state == "applied" and unmatched == []
    assert sorted(o.path for o in result.applied) == ["a.txt", "d/x", "new.txt"]
    assert (env.root / "a.txt").read_text() == "A\n"
    assert (env.root / "new.txt").read_text() == "new\n"
    _, again, _ = env.changesets.apply(env.writer, env.ws, cs_id, None, False, ACTOR)
    assert again.applied == () and len(again.unchanged) == 3


def test_apply_named_paths_only(env: Env) -> None:
    cs_id = env.keep()
    kept, result, unmatched = env.changesets.apply(
        env.writer, env.ws, cs_id, ["d", "nope"], False, ACTOR
    )
    assert [o.path for o in result.applied] == ["d/x"]
    assert unmatched == ["nope"]
    assert kept.state == "pending"  # a partial apply leaves the rest for review
    assert (env.root / "d" / "x").read_text() == "X\n"
    assert (env.root / "a.txt").read_text() == "a\n"


def test_dry_run_writes_nothing(env: Env) -> None:
    cs_id = env.keep()
    kept, result, _ = env.changesets.apply(env.writer, env.ws, cs_id, None, True, ACTOR)
    assert kept.state == "pending"
    assert sorted(o.path for o in result.applied) == ["a.txt", "d/x", "new.txt"]
    assert (env.root / "a.txt").read_text() == "a\n"
    assert not (env.root / "new.txt").exists()


def test_a_host_edit_since_is_a_conflict_never_overwritten(env: Env) -> None:
    cs_id = env.keep()
    (env.root / "a.txt").write_text("host\n")
    _, result, _ = env.changesets.apply(env.writer, env.ws, cs_id, None, False, ACTOR)
    assert [o.path for o in result.conflicts] == ["a.txt"]
    assert (env.root / "a.txt").read_text() == "host\n"


def test_discard_removes_the_layer_and_refuses_later_apply(env: Env) -> None:
    cs_id = env.keep()
    kept = env.changesets.discard(env.ws, cs_id, ACTOR)
    assert kept.state == "discarded"
    assert not env.upper.exists() and not env.work.exists()
    assert env.changesets.discard(env.ws, cs_id, ACTOR).state == "discarded"
    with pytest.raises(ChangesetUnknown) as info:
        env.changesets.apply(env.writer, env.ws, cs_id, None, False, ACTOR)
    assert info.value.data == {"discarded": True}
    assert (env.root / "a.txt").read_text() == "a\n"


def test_unknown_id_is_refused(env: Env) -> None:
    with pytest.raises(ChangesetUnknown):
        env.changesets.get("cs_0000000000000000")
    with pytest.raises(ChangesetUnknown):
        env.changesets.discard(env.ws, "cs_0000000000000000", ACTOR)
