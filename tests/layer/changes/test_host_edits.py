"""The base a layer command saw, against what the host did meanwhile, on a real overlay
mount (no engine): a host delete, rename-away or rename-replace of a file the command
changed is a conflict, never undone or overwritten (`layer.conclusion`, docs/
working-layer.md "Host edits during a command")."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from substrate.layer import conclusion
from substrate.layer.changes import ApplyResult
from substrate.layer.mounts import working_layer
from substrate.layer.mounts.lower_watch import LowerWatch
from substrate.layer.mounts.plan import LayerPlan, plan
from substrate.layer.mounts.working_layer import WorkingLayer, next_plan
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Writer
from tests.harness.state import DaemonState

ACTOR = "agent:0"
FILES: dict[str, str | bytes] = {
    "b.txt": "b\n",
    "keep.txt": "k\n",
    "sub/s.txt": "s\n",
    "quiet/q.txt": "q\n",
}


def fs_clock_after(probe_dir: Path, *paths: Path) -> int:
    """A file-system timestamp later than the ctime of each of `paths`: what a change
    made from now on has at least (the clock only moves on; waits for its next tick)."""
    newest = max(p.stat().st_ctime_ns for p in paths)
    marker = probe_dir / "clock"
    for _ in range(1_000_000):
        marker.write_bytes(b"")
        now = marker.stat().st_ctime_ns
        if now > newest:
            return now
    raise AssertionError("the file-system clock did not move")


@dataclass
class Env:
    root: Path
    tmp: Path
    ws: Workspace
    writer: Writer
    layer: WorkingLayer
    merged: Path

    def mount(self) -> None:
        p = self.layer.plan
        Path(p.upper).mkdir(parents=True)
        Path(p.work).mkdir(parents=True)
        options = f"lowerdir={self.root},upperdir={p.upper},workdir={p.work}"
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(self.merged)], check=True
        )

    def unmount(self) -> None:
        subprocess.run(["umount", str(self.merged)], check=True)

    def begin_now(self) -> None:
        """The generation's first user starts: after everything made so far."""
        dirs = [self.root, *(p for p in self.root.rglob("*") if p.is_dir())]
        self.layer.began = (self.layer.plan.generation, fs_clock_after(self.tmp, *dirs))

    def conclude(self) -> ApplyResult:
        """What `conclusion.conclude` does after its swap: scan the quiet upper, keep the
        host's edits apart, apply the rest."""
        self.unmount()
        old: LayerPlan = self.layer.plan
        result, *_ = conclusion._scan_apply(
            self.writer, self.ws, old, ACTOR, self.layer, False, None
        )
        return result

    def next_generation(self) -> None:
        self.layer.plan = next_plan(self.layer.plan)
        self.mount()


@pytest.fixture
def env(
    daemon_state: DaemonState, tmp_path: Path, make_workspace: Callable[..., Path]
) -> Iterator[Env]:
    root = make_workspace("demo", FILES)
    state, store, journal = daemon_state.path, daemon_state.store, daemon_state.journal
    ws = daemon_state.registry.adopt(str(root), None, None, ACTOR)
    layer = WorkingLayer(plan=plan(str(state), "s0123456789abcdef", 0, []))
    merged = tmp_path / "merged"
    merged.mkdir()
    e = Env(root, tmp_path, ws, Writer(store, journal), layer, merged)
    e.mount()
    try:
        yield e
    finally:
        if os.path.ismount(merged):
            e.unmount()


def outcomes(result: ApplyResult, kind: str) -> list[tuple[str, str, str | None]]:
    return [(o.path, o.op, o.reason) for o in getattr(result, kind)]


def test_a_file_the_host_deleted_while_the_command_changed_it_stays_deleted(env: Env) -> None:
    env.begin_now()
    with open(env.merged / "b.txt", "a") as f:  # modified in place: an overlay copy-up
        f.write("sandbox\n")
    (env.root / "b.txt").unlink()  # the person deletes it meanwhile
    result = env.conclude()
    assert outcomes(result, "conflicts") == [("b.txt", "create", "host_changed")]
    assert result.applied == ()
    assert not (env.root / "b.txt").exists()
    (conflict,) = result.conflicts
    assert conflict.kept == "b.txt" and conflict.current_sha256 is None  # the command's bytes


def test_a_rename_away_during_an_editor_style_save_is_a_conflict(env: Env) -> None:
    env.begin_now()
    # The command saves by rename (sed -i, an editor): no copy-up marks the new file.
    (env.merged / ".b.txt.tmp").write_text("b\nsandbox\n")
    os.rename(env.merged / ".b.txt.tmp", env.merged / "b.txt")
    os.rename(env.root / "b.txt", env.root / "moved.txt")  # the person renames it away
    result = env.conclude()
    assert outcomes(result, "conflicts") == [("b.txt", "create", "host_changed")]
    assert not (env.root / "b.txt").exists()
    assert (env.root / "moved.txt").read_text() == "b\n"


def test_a_directory_the_host_removed_is_not_made_again(env: Env) -> None:
    env.begin_now()
    with open(env.merged / "sub" / "s.txt", "a") as f:
        f.write("sandbox\n")
    (env.merged / "sub" / "new.txt").write_text("n\n")
    (env.root / "sub" / "s.txt").unlink()
    (env.root / "sub").rmdir()
    result = env.conclude()
    assert outcomes(result, "conflicts") == [
        ("sub", "mkdir", "host_changed"),
        ("sub/new.txt", "create", "host_changed"),
        ("sub/s.txt", "create", "host_changed"),
    ]
    assert not (env.root / "sub").exists()


def test_a_host_replace_by_rename_is_a_conflict_never_overwritten(env: Env) -> None:
    env.begin_now()
    with open(env.merged / "b.txt", "a") as f:
        f.write("sandbox\n")
    (env.root / ".b.save").write_text("person\n")
    os.rename(env.root / ".b.save", env.root / "b.txt")
    result = env.conclude()
    assert outcomes(result, "conflicts") == [("b.txt", "replace", "host_changed")]
    assert (env.root / "b.txt").read_text() == "person\n"


def test_a_create_the_host_made_meanwhile_is_a_conflict(env: Env) -> None:
    env.begin_now()
    (env.merged / "both.txt").write_text("sandbox\n")
    (env.root / "both.txt").write_text("person\n")
    result = env.conclude()
    assert outcomes(result, "conflicts") == [("both.txt", "replace", "host_changed")]
    assert (env.root / "both.txt").read_text() == "person\n"


def test_creates_where_the_host_removed_nothing_apply(env: Env) -> None:
    env.begin_now()
    (env.merged / "quiet" / "new.txt").write_text("n\n")  # the host leaves quiet/ alone
    (env.merged / "cache" / "deep").mkdir(parents=True)  # new dirs the command made
    (env.merged / "cache" / "deep" / "c.txt").write_text("c\n")
    (env.root / "person.txt").write_text("p\n")  # ... while the host adds beside them
    result = env.conclude()
    assert result.conflicts == ()
    assert outcomes(result, "applied") == [
        ("cache", "mkdir", None),
        ("cache/deep", "mkdir", None),
        ("cache/deep/c.txt", "create", None),
        ("quiet/new.txt", "create", None),
    ]
    # A new file in a directory the host changed meanwhile cannot be told from one
    # the host removed: a conflict (safe), never a re-creation.
    env.next_generation()
    env.begin_now()
    (env.merged / "top.txt").write_text("t\n")
    (env.root / "person2.txt").write_text("p\n")
    result = env.conclude()
    assert outcomes(result, "conflicts") == [("top.txt", "create", "host_changed")]
    assert not (env.root / "top.txt").exists()


def test_what_the_previous_set_put_in_a_directory_is_no_host_edit(env: Env) -> None:
    began = fs_clock_after(env.tmp, env.root, env.root / "quiet")
    env.layer.began = (0, began)
    (env.merged / "quiet" / "one.txt").write_text("1\n")
    assert outcomes(env.conclude(), "applied") == [("quiet/one.txt", "create", None)]
    # The next generation begins before that apply's rename by the clock (the slack
    # for a coarse clock): the directory it changed is the layer's, not the host's.
    env.next_generation()
    env.layer.began = (1, began)
    (env.merged / "quiet" / "two.txt").write_text("2\n")
    result = env.conclude()
    assert result.conflicts == ()
    assert outcomes(result, "applied") == [("quiet/two.txt", "create", None)]


def test_a_host_save_while_the_generation_stays_mounted_is_a_conflict(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(working_layer, "CTIME_SLACK_NS", 0)
    env.begin_now()
    assert (env.merged / "b.txt").read_text() == "b\n"  # a command that changes nothing
    assert not conclusion._changed(env.layer, env.ws)  # the generation stays mounted
    (env.root / ".b.save").write_text("person\n")  # the person saves by rename
    os.rename(env.root / ".b.save", env.root / "b.txt")
    working_layer.begin(env.layer)  # the next command, on the same overlay
    with open(env.merged / "b.txt", "a") as f:  # the overlay may still show the old file
        f.write("sandbox\n")
    result = env.conclude()
    assert outcomes(result, "conflicts") == [("b.txt", "replace", "host_changed")]
    assert (env.root / "b.txt").read_text() == "person\n"


def test_with_the_watch_a_create_beside_an_unrelated_host_change_applies(env: Env) -> None:
    # The checkout's watch names what the host changed (docs/working-layer.md, "The fresh
    # view"): a create is a conflict only where the host touched that very name.
    env.layer.watch = LowerWatch.open(env.ws.root_fd)
    env.layer.watch.mounted()
    env.begin_now()
    (env.merged / "top.txt").write_text("t\n")
    (env.merged / "sub" / "gone.txt").write_text("mine\n")
    (env.root / "person.txt").write_text("p\n")  # beside top.txt: unrelated
    (env.root / "sub" / "gone.txt").write_text("person's\n")  # the same name: made...
    (env.root / "sub" / "gone.txt").unlink()  # ... and removed by the person
    result = env.conclude()
    assert outcomes(result, "applied") == [("top.txt", "create", None)]
    assert outcomes(result, "conflicts") == [("sub/gone.txt", "create", "host_changed")]
    assert not (env.root / "sub" / "gone.txt").exists()
    # Names unknown (events lost, say): the directory's ctime decides, as without a watch.
    env.next_generation()
    env.layer.watch.mounted()
    env.begin_now()
    env.layer.watch.forget_names()
    (env.merged / "top2.txt").write_text("t\n")
    (env.root / "person2.txt").write_text("p\n")
    result = env.conclude()
    assert outcomes(result, "conflicts") == [("top2.txt", "create", "host_changed")]
    env.layer.watch.close()
