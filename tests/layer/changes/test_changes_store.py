"""substrate.layer.changes.store: change sets kept by id, applied later through the
guarded path (all or some paths, dry run, twice), discarded with their layer; conflicts'
versions kept as artifacts (`layer.changes.versions`, `layer.keep`), a settled set's
layer removed, kept sets counted and reattached to a re-adopted checkout."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from substrate.api.changes import bounded_diffs
from substrate.artifacts.store import ArtifactStore
from substrate.errors import ChangesetUnknown, LimitExceeded
from substrate.layer import keep as layer_keep
from substrate.layer.changes import ApplyResult, ChangeSet, Changesets, Kept, scan, versions
from substrate.layer.changes import store as store_mod
from substrate.layer.keep import ArtifactKeeper
from substrate.schema.changes import Change
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from substrate.workspace.writes import Writer
from tests.harness.state import DaemonState

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
    registry: WorkspaceRegistry
    artifacts: ArtifactStore
    store: Store

    def keep(self, held: tuple[str, ...] = (), **bounds: int) -> str:
        ufd = os.open(self.upper, DIR)
        try:
            cs: ChangeSet = scan(ufd, self.ws.root_fd, **bounds)
        finally:
            os.close(ufd)
        return self.changesets.record(
            self.ws, 3, str(self.upper), str(self.work), cs, "pending", held
        )

    def apply(self, cs_id: str, only: list[str] | None = None) -> tuple[Kept, ApplyResult]:
        kept, result, _ = self.changesets.apply(self.writer, self.ws, cs_id, only, False, ACTOR)
        return kept, result

    def artifact_bytes(self, artifact: str | None) -> bytes:
        assert artifact is not None
        return self.artifacts.read_artifact(artifact, 0, 1 << 20)


@pytest.fixture
def env(daemon_state: DaemonState, tmp_path: Path, make_workspace: Callable[..., Path]) -> Env:
    root = make_workspace("demo", {"a.txt": "a\n", "d/x": "x\n", "keep.txt": "k\n"})
    state, store, journal = daemon_state.path, daemon_state.store, daemon_state.journal
    registry = daemon_state.registry
    ws = registry.adopt(str(root), None, Policy(require_approval=["gated/**"]), ACTOR)
    artifacts = ArtifactStore(store, state / "artifacts", quota_bytes=1 << 30, max_age_s=3600)
    changesets = Changesets(store, journal, ArtifactKeeper(artifacts))
    upper, work = tmp_path / "layers" / "upper" / "3", tmp_path / "layers" / "work" / "3"
    (upper / "d").mkdir(parents=True)
    work.mkdir(parents=True)
    (upper / "a.txt").write_text("A\n")
    (upper / "d" / "x").write_text("X\n")
    (upper / "new.txt").write_text("new\n")
    return Env(
        root,
        upper,
        work,
        ws,
        Writer(store, journal),
        journal,
        changesets,
        registry,
        artifacts,
        store,
    )


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


def test_apply_lands_everything_once_then_removes_the_layer(env: Env) -> None:
    cs_id = env.keep()
    assert env.changesets.count_kept(env.ws.id) == 1
    kept, result, unmatched = env.changesets.apply(env.writer, env.ws, cs_id, None, False, ACTOR)
    assert kept.state == "applied" and unmatched == []
    assert sorted(o.path for o in result.applied) == ["a.txt", "d/x", "new.txt"]
    assert (env.root / "a.txt").read_text() == "A\n"
    assert (env.root / "new.txt").read_text() == "new\n"
    # Settled: nothing pending, no conflict. Its layer is gone, the row says so.
    assert kept.layer == "removed"
    assert not env.upper.exists() and not env.work.exists()
    assert env.changesets.get(cs_id).layer == "removed"
    assert env.changesets.count_kept(env.ws.id) == 0
    # Nothing is left to apply: a host delete since is not undone by a second apply.
    (env.root / "new.txt").unlink()
    kept, again = env.apply(cs_id)
    assert again == ApplyResult() and kept.state == "applied"
    assert not (env.root / "new.txt").exists()


def test_what_a_scan_bound_blocked_keeps_the_layer(env: Env) -> None:
    (env.upper / "d" / "deep" / "er").mkdir(parents=True)
    (env.upper / "d" / "deep" / "er" / "f").write_text("f\n")
    cs_id = env.keep(max_depth=2)
    blocked = [(b.path, b.reason) for b in env.changesets.get(cs_id).changeset.blocked]
    assert blocked == [("d/deep/er", "too_deep")]
    kept, result = env.apply(cs_id)
    assert sorted(o.path for o in result.applied) == ["a.txt", "d/deep", "d/x", "new.txt"]
    # Applied whole, nothing pending, no conflict: but the deep part is only in the
    # layer, so the layer stays until `changes.discard`.
    assert kept.state == "applied" and kept.layer == "kept"
    assert (env.upper / "d" / "deep" / "er" / "f").read_text() == "f\n"
    assert env.changesets.count_kept(env.ws.id) == 1
    env.changesets.discard(env.ws, cs_id, ACTOR)
    assert not env.upper.exists()


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


def test_a_host_edit_since_is_a_conflict_kept_as_an_artifact(env: Env) -> None:
    cs_id = env.keep()
    mode = stat.S_IMODE((env.upper / "a.txt").stat().st_mode)
    (env.root / "a.txt").write_text("host\n")
    kept, result = env.apply(cs_id)
    assert [o.path for o in result.conflicts] == ["a.txt"]
    assert (env.root / "a.txt").read_text() == "host\n"
    # The command's version is an artifact of the set; the layer could go.
    (version,) = kept.versions.items
    assert (version.path, version.size, version.reason) == ("a.txt", 2, None)
    assert env.artifact_bytes(version.artifact) == b"A\n"
    assert version.artifact is not None
    found = env.artifacts.stat(version.artifact)
    assert (found.proc, found.stream, found.sha256) == (cs_id, "conflict", version.sha256)
    assert kept.layer == "removed" and not env.upper.exists()
    assert env.changesets.get(cs_id).versions == kept.versions
    # The wire entry names it, with the command's size and mode, and no layer path.
    by_path = {c.path: c for c in kept.changeset.changes}
    (entry,) = layer_keep.entries(result.conflicts, by_path, kept.versions)
    assert entry.artifact == version.artifact and entry.kept is None
    assert entry.size == 2 and entry.mode == mode
    (applied,) = [e for e in layer_keep.entries(result.applied, by_path) if e.path == "new.txt"]
    assert applied.size == 4 and applied.artifact is None


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


def test_a_pending_change_keeps_the_layer_until_approved_and_applied(env: Env) -> None:
    for top in (env.root, env.upper):  # the directory stands in the checkout already
        (top / "gated").mkdir(mode=0o755)
        os.chmod(top / "gated", 0o755)
    (env.upper / "gated" / "g.txt").write_text("g\n")
    cs_id = env.keep()
    kept, result = env.apply(cs_id)
    assert kept.state == "applied" and [o.path for o in result.pending] == ["gated/g.txt"]
    assert kept.layer == "kept" and env.upper.exists()
    assert env.changesets.count_kept(env.ws.id) == 1
    (pending,) = result.pending
    assert pending.plan_digest is not None
    env.registry.grant_approval(env.ws, pending.plan_digest, 60, "operator:0")
    kept, again = env.apply(cs_id)
    assert [o.path for o in again.applied] == ["gated/g.txt"]
    assert (env.root / "gated" / "g.txt").read_text() == "g\n"
    assert kept.layer == "removed" and not env.upper.exists()
    assert env.changesets.count_kept(env.ws.id) == 0


def test_a_version_over_the_file_cap_stays_in_the_layer(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(versions, "MAX_VERSION_BYTES", 1)
    (env.root / "empty").write_text("e\n")
    (env.upper / "empty").write_text("")
    cs_id = env.keep()
    for name in ("a.txt", "d/x", "empty"):
        (env.root / name).write_text("host\n")
    kept, result = env.apply(cs_id)
    assert sorted(o.path for o in result.conflicts) == ["a.txt", "d/x", "empty"]
    reasons = {v.path: (v.artifact, v.reason) for v in kept.versions.items}
    assert reasons == {
        "a.txt": (None, "too_large"),
        "d/x": (None, "too_large"),
        "empty": (None, "empty"),
    }
    # Not kept elsewhere: the layer stays (counted), the entry names the file in it.
    assert kept.layer == "kept" and (env.upper / "a.txt").read_text() == "A\n"
    assert env.changesets.count_kept(env.ws.id) == 1
    entries = {e.path: e for e in layer_keep.entries(result.conflicts, None, kept.versions)}
    assert (entries["a.txt"].artifact_reason, entries["a.txt"].kept) == ("too_large", "a.txt")
    assert (entries["empty"].artifact_reason, entries["empty"].kept) == ("empty", None)
    env.changesets.discard(env.ws, cs_id, ACTOR)
    assert not env.upper.exists()


def test_past_the_sets_version_cap_the_layer_stays(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(versions, "MAX_SET_VERSIONS", 1)
    cs_id = env.keep()
    (env.root / "a.txt").write_text("host\n")
    (env.root / "d" / "x").write_text("host\n")
    kept, result = env.apply(cs_id)
    assert len(result.conflicts) == 2 and len(kept.versions.items) == 1
    assert kept.versions.overflow and kept.layer == "kept"
    (first,) = kept.versions.items
    assert env.artifact_bytes(first.artifact) in (b"A\n", b"X\n")
    reasons = [e.artifact_reason for e in layer_keep.entries(result.conflicts, None, kept.versions)]
    assert sorted(reasons, key=str) == [None, "set_full"]


def test_host_changed_versions_are_copied_even_after_a_crash(env: Env) -> None:
    # Recorded with the set before anything else: a crash before the copy (the row
    # `applying`, versions `unkept`) never lets the layer go without them.
    ufd = os.open(env.upper, DIR)
    try:
        cs = scan(ufd, env.ws.root_fd)
    finally:
        os.close(ufd)
    cs_id = env.changesets.record(
        env.ws, 3, str(env.upper), str(env.work), cs, "applying", ["a.txt"]
    )
    assert [(v.path, v.reason) for v in env.changesets.get(cs_id).versions.items] == [
        ("a.txt", "unkept")
    ]
    kept = env.changesets.get(cs_id)
    assert env.changesets.finish_applying(env.writer, env.ws, kept) is not None
    kept = env.changesets.get(cs_id)
    (version,) = kept.versions.items
    assert env.artifact_bytes(version.artifact) == b"A\n"
    assert kept.state == "applied" and kept.layer == "removed"


def test_a_set_without_a_keeper_keeps_its_conflicting_layer(env: Env) -> None:
    bare = Changesets(env.store, env.journal)  # no artifact store
    ufd = os.open(env.upper, DIR)
    try:
        cs = scan(ufd, env.ws.root_fd)
    finally:
        os.close(ufd)
    cs_id = bare.record(env.ws, 3, str(env.upper), str(env.work), cs, "pending", ["a.txt"])
    kept, _, _ = bare.apply(env.writer, env.ws, cs_id, None, False, ACTOR)
    assert kept.layer == "kept" and env.upper.exists()


def test_settled_rows_are_pruned(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "MAX_SETTLED", 1)
    ids = []
    for i in range(3):
        (env.upper / f"n{i}").write_text("n\n")
        cs_id = env.keep()
        env.apply(cs_id)
        ids.append(cs_id)
        env.upper.mkdir(exist_ok=True)
        env.work.mkdir(exist_ok=True)
    with pytest.raises(ChangesetUnknown):
        env.changesets.get(ids[0])
    assert env.changesets.get(ids[2]).layer == "removed"


def test_kept_sets_follow_the_checkout_to_its_next_adoption(env: Env) -> None:
    cs_id = env.keep()
    env.registry.release(env.ws.id, ACTOR)
    again = env.registry.adopt(str(env.root), None, None, ACTOR)
    assert again.id != env.ws.id
    with pytest.raises(ChangesetUnknown):  # not the new workspace's yet
        env.changesets.apply(env.writer, again, cs_id, None, True, ACTOR)
    assert env.changesets.reattach(again) == 1
    assert env.changesets.reattach(again) == 0
    assert env.changesets.count_kept(again.id) == 1
    kept, result, _ = env.changesets.apply(env.writer, again, cs_id, None, False, ACTOR)
    assert kept.workspace == again.id and len(result.applied) == 3
    assert (env.root / "a.txt").read_text() == "A\n"
    moved = [e for e in env.journal.read(limit=1000) if e.kind == "changes.reattached"]
    assert [(e.workspace, e.data) for e in moved] == [(again.id, {"changesets": 1})]


def test_check_room_refuses_past_the_cap_but_never_discard(env: Env) -> None:
    env.keep()
    env.keep()
    layer_keep.check_room(env.changesets, env.ws.id, "review", 3)
    with pytest.raises(LimitExceeded) as info:
        layer_keep.check_room(env.changesets, env.ws.id, "review", 2)
    assert info.value.data == {"limit": 2, "scope": "kept_changesets", "kept": 2}
    with pytest.raises(LimitExceeded):
        layer_keep.check_room(env.changesets, env.ws.id, "apply", 2)
    layer_keep.check_room(env.changesets, env.ws.id, "discard", 2)


def test_changes_get_bounds_the_diff_text_of_one_answer() -> None:
    made = [Change(path=f"f{i}", op="create", diff="x" * 10) for i in range(4)]
    shown = bounded_diffs(tuple(made), 25)
    assert [c.diff for c in shown] == ["x" * 10, "x" * 10, "", ""]
    assert [c.diff_truncated for c in shown] == [False, False, True, True]


class _Flaky:
    """A keeper whose first copy fails, then copies into the real store."""

    def __init__(self, real: ArtifactKeeper) -> None:
        self.real = real
        self.calls = 0

    def keep_file(self, fd: int, size: int, owner: str) -> tuple[str, str] | None:
        self.calls += 1
        if self.calls == 1:
            raise OSError(28, "No space left on device")
        return self.real.keep_file(fd, size, owner)


def test_a_failed_copy_holds_the_layer_and_is_retried(env: Env) -> None:
    flaky = _Flaky(ArtifactKeeper(env.artifacts))
    changesets = Changesets(env.store, env.journal, flaky)
    ufd = os.open(env.upper, DIR)
    try:
        cs = scan(ufd, env.ws.root_fd)
    finally:
        os.close(ufd)
    cs_id = changesets.record(env.ws, 3, str(env.upper), str(env.work), cs, "pending")
    (env.root / "a.txt").write_text("host\n")
    kept, result, _ = changesets.apply(env.writer, env.ws, cs_id, None, False, ACTOR)
    assert [(v.path, v.reason) for v in kept.versions.items] == [("a.txt", "failed")]
    assert kept.layer == "kept" and env.upper.exists()
    (entry,) = layer_keep.entries(result.conflicts, None, kept.versions)
    assert (entry.artifact_reason, entry.kept) == ("failed", "a.txt")
    kept, _, _ = changesets.apply(env.writer, env.ws, cs_id, None, False, ACTOR)
    (version,) = kept.versions.items
    assert env.artifact_bytes(version.artifact) == b"A\n"
    assert kept.layer == "removed" and not env.upper.exists()
    assert (env.root / "a.txt").read_text() == "host\n"


def test_the_kept_set_cap_is_decided_on_the_loop_unless_the_database_is_busy(env: Env) -> None:
    env.keep()
    # Free: decided at once, the refusal as `check_room`'s.
    assert layer_keep.room_now(env.changesets, env.ws.id, "keep", 2) is True
    with pytest.raises(LimitExceeded) as refused:
        layer_keep.room_now(env.changesets, env.ws.id, "keep", 1)
    assert refused.value.data["scope"] == "kept_changesets" and refused.value.data["kept"] == 1
    assert layer_keep.room_now(env.changesets, env.ws.id, "discard", 1) is True  # keeps none
    # Another thread holds the database: not decided (the caller asks from a thread).
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with env.store.transaction():
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        assert layer_keep.room_now(env.changesets, env.ws.id, "keep", 1) is False
    finally:
        release.set()
        holder.join()
    with pytest.raises(LimitExceeded):
        layer_keep.check_room(env.changesets, env.ws.id, "keep", 1)
