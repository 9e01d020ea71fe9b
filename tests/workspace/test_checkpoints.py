"""substrate.workspace.checkpoints and .restore in-process: pre-images kept with the
journal seq, restore through the guarded path, conflicts kept, the quota."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.errors import CheckpointUnknown, all_refusals
from substrate.schema.fs import (
    DeleteParams,
    Edit,
    PatchParams,
    Plan,
    WriteParams,
    patch_request,
    write_request,
)
from substrate.schema.workspace import Policy, RestoreResult
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.checkpoints import BLOB_DIR, Checkpoints
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from substrate.workspace.restore import restore
from substrate.workspace.writes import Writer
from tests.harness.state import DaemonState

ACTOR = "agent:0"
#: Bytes that must never reach the journal: the pre-image of `secret.txt`.
MARKER = "pre-image-marker-7f3a9c"
FILES: dict[str, str | bytes] = {
    "keep.txt": "unchanged\n",
    "a.txt": "alpha\n",
    "run.sh": "#!/bin/sh\necho one\n",
    "gone.txt": "to be deleted\n",
    "host.txt": "host original\n",
    "secret.txt": f"token {MARKER}\n",
    "ci/deploy.yml": "steps: []\n",
}


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@dataclass
class Env:
    root: Path
    state: Path
    ws: Workspace
    writer: Writer
    checkpoints: Checkpoints
    store: Store
    journal: Journal
    registry: WorkspaceRegistry

    def write(self, path: str, content: str, base: str | None, **kw: Any) -> Plan:
        p = WriteParams(workspace=self.ws.id, path=path, content=content, base_sha256=base, **kw)
        return self.writer.write(self.ws, write_request(p), ACTOR)

    def patch(self, path: str, base: str, old: str, new: str) -> Plan:
        p = PatchParams(
            workspace=self.ws.id, path=path, base_sha256=base, edits=[Edit(old=old, new=new)]
        )
        return self.writer.patch(self.ws, patch_request(p), ACTOR)

    def delete(self, path: str, base: str) -> Plan:
        return self.writer.delete(
            self.ws, DeleteParams(workspace=self.ws.id, path=path, base_sha256=base), ACTOR
        )

    def checkpoint(self) -> tuple[str, int]:
        return self.checkpoints.create(self.ws, ACTOR)

    def restore(self, checkpoint: str, dry_run: bool = False) -> RestoreResult:
        return restore(
            self.writer, self.checkpoints, self.journal, self.ws, checkpoint, dry_run, ACTOR
        )

    def sha(self, rel: str) -> str:
        return sha((self.root / rel).read_bytes())

    def mode(self, rel: str) -> int:
        return stat.S_IMODE((self.root / rel).stat().st_mode)

    def kinds(self, kind: str) -> list[Any]:
        return [e for e in self.journal.read(limit=100000) if e.kind == kind]


def open_env(made: DaemonState, root: Path, quota: int, policy: Policy | None) -> Env:
    store, journal, state = made.store, made.journal, made.path
    ws = made.registry.adopt(str(root), None, policy, ACTOR)
    checkpoints = Checkpoints(store, journal, state, quota)
    writer = Writer(store, journal, checkpoints)
    return Env(root, state, ws, writer, checkpoints, store, journal, made.registry)


@pytest.fixture
def quota() -> int:
    return 1 << 30


@pytest.fixture
def env(
    daemon_state: DaemonState, make_workspace: Callable[..., Path], quota: int
) -> Iterator[Env]:
    root = make_workspace("demo", FILES, git=True)
    (root / "run.sh").chmod(0o755)
    (root / "a.txt").chmod(0o600)
    policy = Policy(require_approval=["ci/**"])
    e = open_env(daemon_state, root, quota, policy)
    try:
        yield e
    finally:
        e.checkpoints.close()


def paths_of(result: RestoreResult, name: str) -> list[str]:
    return sorted(f.path.split(":", 1)[1] for f in getattr(result, name))


def mixed_writes(env: Env) -> None:
    """A create, two replaces (one changing the mode), a patch, a delete, and a file the
    host edits after substrate's write."""
    env.write("new/made.txt", "created\n", None, create_parents=True)
    env.write("a.txt", "alpha 2\n", sha("alpha\n"), mode=0o644)
    env.write("a.txt", "alpha 3\n", sha("alpha 2\n"))
    env.patch("run.sh", sha("#!/bin/sh\necho one\n"), "one", "two")
    env.delete("gone.txt", sha("to be deleted\n"))
    env.write("host.txt", "ours\n", sha("host original\n"))
    (env.root / "host.txt").write_text("the person's edit\n")


def test_restore_puts_back_exact_bytes_and_modes_and_keeps_a_host_edit(env: Env) -> None:
    checkpoint, seq = env.checkpoint()
    (entry,) = env.kinds("workspace.checkpoint")
    assert entry.seq == seq and entry.data == {"checkpoint": checkpoint}
    mixed_writes(env)

    result = env.restore(checkpoint)

    assert (env.root / "a.txt").read_bytes() == b"alpha\n" and env.mode("a.txt") == 0o600
    assert (env.root / "run.sh").read_text() == "#!/bin/sh\necho one\n"
    assert env.mode("run.sh") == 0o755
    assert (env.root / "gone.txt").read_text() == "to be deleted\n"
    assert not (env.root / "new" / "made.txt").exists()
    assert (env.root / "host.txt").read_text() == "the person's edit\n"  # never overwritten
    assert paths_of(result, "restored") == ["a.txt", "gone.txt", "new/made.txt", "run.sh"]
    (conflict,) = result.conflicts
    assert conflict.path.endswith(":host.txt") and conflict.reason == "changed_since"
    assert conflict.current_sha256 == env.sha("host.txt")
    assert conflict.base_sha256 == sha("ours\n")
    deleted = next(f for f in result.restored if f.path.endswith("new/made.txt"))
    assert deleted.action == "delete" and deleted.sha256 is None
    assert result.counts.restored == 4 and result.counts.conflicts == 1
    assert not result.truncated and result.seq == seq
    # One journal entry per restored file, and the summary.
    assert len(env.kinds("workspace.restore_file")) == 4
    (summary,) = env.kinds("workspace.restore")
    assert summary.data["restored"] == 4 and summary.data["conflicts"] == 1


def test_dry_run_changes_nothing_and_says_what_restore_would_do(
    env: Env, snapshot_tree: Callable[[Path], dict[str, tuple[Any, ...]]]
) -> None:
    checkpoint, _ = env.checkpoint()
    mixed_writes(env)
    before = snapshot_tree(env.root)
    journaled = env.journal.count()

    dry = env.restore(checkpoint, dry_run=True)

    assert snapshot_tree(env.root) == before
    assert env.journal.count() == journaled
    assert dry.dry_run and dry.counts.restored == 4 and dry.counts.conflicts == 1
    real = env.restore(checkpoint)
    assert paths_of(real, "restored") == paths_of(dry, "restored")
    assert [f.plan_digest for f in real.restored] == [f.plan_digest for f in dry.restored]


def test_restore_twice_changes_nothing_the_second_time(
    env: Env, snapshot_tree: Callable[[Path], dict[str, tuple[Any, ...]]]
) -> None:
    checkpoint, _ = env.checkpoint()
    mixed_writes(env)
    env.restore(checkpoint)
    after_first = snapshot_tree(env.root)
    files_journaled = len(env.kinds("workspace.restore_file"))

    again = env.restore(checkpoint)

    assert snapshot_tree(env.root) == after_first
    assert len(env.kinds("workspace.restore_file")) == files_journaled
    assert again.restored == [] and again.counts.unchanged == 4
    assert paths_of(again, "conflicts") == ["host.txt"]


def test_a_restore_can_itself_be_undone_by_a_later_checkpoint(env: Env) -> None:
    first, _ = env.checkpoint()
    env.write("a.txt", "alpha 2\n", sha("alpha\n"))
    second, _ = env.checkpoint()
    env.restore(first)
    assert (env.root / "a.txt").read_text() == "alpha\n"
    result = env.restore(second)
    assert paths_of(result, "restored") == ["a.txt"]
    assert (env.root / "a.txt").read_text() == "alpha 2\n"


def test_unknown_checkpoint_is_refused_by_name(env: Env) -> None:
    assert all_refusals()["checkpoint_unknown"] is CheckpointUnknown
    with pytest.raises(CheckpointUnknown) as info:
        env.restore("ckp_0000000000000000")
    assert info.value.name == "checkpoint_unknown" and "expired" not in info.value.data


def test_a_checkpoint_of_another_workspace_is_unknown_here(
    env: Env, make_workspace: Callable[..., Path]
) -> None:
    other = env.registry.adopt(str(make_workspace("other", {"x": "x\n"})), None, None, ACTOR)
    theirs, _ = env.checkpoints.create(other, ACTOR)
    with pytest.raises(CheckpointUnknown):
        env.restore(theirs)


def test_preimage_bytes_never_reach_the_journal(env: Env) -> None:
    checkpoint, _ = env.checkpoint()
    env.write("secret.txt", "rotated\n", sha(f"token {MARKER}\n"))
    env.delete("secret.txt", sha("rotated\n"))
    env.restore(checkpoint)
    assert (env.root / "secret.txt").read_text() == f"token {MARKER}\n"
    rows = env.store.query("SELECT * FROM journal")
    assert rows and not any(MARKER in " ".join(map(str, tuple(row))) for row in rows)
    # The bytes live under the state dir, content-addressed.
    digest = sha(f"token {MARKER}\n")
    blob = env.state / BLOB_DIR / digest[:2] / digest[2:]
    assert blob.read_text() == f"token {MARKER}\n"
    assert stat.S_IMODE(blob.stat().st_mode) == 0o600


def test_nothing_is_kept_without_a_live_checkpoint(env: Env) -> None:
    env.write("a.txt", "alpha 2\n", sha("alpha\n"))
    assert env.checkpoints.stored_bytes() == 0
    assert os.listdir(env.state / BLOB_DIR) == []
    assert env.store.query("SELECT COUNT(*) AS n FROM preimages")[0]["n"] == 0


def test_a_change_set_file_is_restored_too(env: Env) -> None:
    checkpoint, _ = env.checkpoint()
    env.writer.apply_change(env.ws, "a.txt", sha("alpha\n"), b"from a command\n", 0o640, ACTOR)
    env.writer.apply_change(env.ws, "gone.txt", sha("to be deleted\n"), None, None, ACTOR)
    result = env.restore(checkpoint)
    assert paths_of(result, "restored") == ["a.txt", "gone.txt"]
    assert (env.root / "a.txt").read_text() == "alpha\n" and env.mode("a.txt") == 0o600
    assert (env.root / "gone.txt").read_text() == "to be deleted\n"


def test_a_path_under_require_approval_is_pending_until_approved(env: Env) -> None:
    checkpoint, _ = env.checkpoint()
    plan = env.write("ci/deploy.yml", "steps: [x]\n", sha("steps: []\n"), dry_run=True)
    env.registry.grant_approval(env.ws, plan.plan_digest, 60, "operator:0")
    env.write("ci/deploy.yml", "steps: [x]\n", sha("steps: []\n"))

    dry = env.restore(checkpoint, dry_run=True)
    result = env.restore(checkpoint)

    (pending,) = result.pending
    assert dry.pending == result.pending and pending.reason == "approval_required"
    assert (env.root / "ci/deploy.yml").read_text() == "steps: [x]\n"
    assert pending.plan_digest is not None
    env.registry.grant_approval(env.ws, pending.plan_digest, 60, "operator:0")
    assert paths_of(env.restore(checkpoint), "restored") == ["ci/deploy.yml"]
    assert (env.root / "ci/deploy.yml").read_text() == "steps: []\n"


def test_a_path_the_policy_denies_now_is_blocked(env: Env) -> None:
    checkpoint, _ = env.checkpoint()
    env.write("a.txt", "alpha 2\n", sha("alpha\n"))
    ws = env.registry.set_policy(env.ws.id, Policy(write_deny=["a.txt"]), "operator:0")
    result = restore(env.writer, env.checkpoints, env.journal, ws, checkpoint, False, ACTOR)
    (blocked,) = result.blocked
    assert blocked.rule == "a.txt" and blocked.reason == "path_denied"
    assert (env.root / "a.txt").read_text() == "alpha 2\n"


@pytest.mark.parametrize("quota", [1000])
def test_over_the_quota_the_oldest_checkpoint_expires(env: Env) -> None:
    big_a, big_b = "a" * 600 + "\n", "b" * 600 + "\n"
    env.write("a.txt", big_a, sha("alpha\n"))
    env.write("keep.txt", big_b, sha("unchanged\n"))
    oldest, _ = env.checkpoint()
    env.write("a.txt", "small\n", sha(big_a))  # keeps 601 bytes: under the quota
    assert env.checkpoints.stored_bytes() == 601
    newer, _ = env.checkpoint()
    env.write("keep.txt", "small\n", sha(big_b))  # 1202 bytes: the oldest must go

    assert env.checkpoints.stored_bytes() == 601
    (expired,) = env.kinds("workspace.checkpoint_expired")
    assert expired.data == {"checkpoint": oldest, "seq": expired.data["seq"], "reason": "quota"}
    with pytest.raises(CheckpointUnknown) as info:
        env.restore(oldest)
    assert info.value.data == {"expired": True}
    # The live one restores in full: its pre-image was never collected.
    result = env.restore(newer)
    assert paths_of(result, "restored") == ["keep.txt"]
    assert (env.root / "keep.txt").read_text() == big_b


def test_sweep_removes_only_blobs_no_row_names(env: Env) -> None:
    checkpoint, _ = env.checkpoint()
    env.write("a.txt", "alpha 2\n", sha("alpha\n"))
    orphan = sha("left by a crash\n")
    sub = env.state / BLOB_DIR / orphan[:2]
    sub.mkdir(exist_ok=True)
    (sub / orphan[2:]).write_text("left by a crash\n")
    assert env.checkpoints.sweep() == 1
    assert not (sub / orphan[2:]).exists()
    assert paths_of(env.restore(checkpoint), "restored") == ["a.txt"]


def test_live_checkpoints_per_workspace_are_bounded(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("substrate.workspace.checkpoints.MAX_LIVE", 2)
    first, _ = env.checkpoint()
    env.checkpoint()
    env.checkpoint()
    (expired,) = env.kinds("workspace.checkpoint_expired")
    assert expired.data["checkpoint"] == first and expired.data["reason"] == "count"
    with pytest.raises(CheckpointUnknown):
        env.restore(first)


@pytest.mark.parametrize("quota", [1000])
def test_the_quota_never_expires_a_checkpoint_under_its_own_restore(env: Env) -> None:
    big = "x" * 1200 + "\n"
    checkpoint, _ = env.checkpoint()
    env.write("a.txt", big, sha("alpha\n"))
    # Putting "alpha" back keeps the 1201 bytes it replaces: over the quota, and this
    # checkpoint is the only (so the oldest) one.
    result = env.restore(checkpoint)
    assert paths_of(result, "restored") == ["a.txt"]
    assert env.kinds("workspace.checkpoint_expired") == []
    assert env.checkpoints.stored_bytes() == 1201 + len("alpha\n")
    # The next write settles the quota; the checkpoint then goes.
    env.write("keep.txt", "changed\n", sha("unchanged\n"))
    (expired,) = env.kinds("workspace.checkpoint_expired")
    assert expired.data["checkpoint"] == checkpoint
    assert env.checkpoints.stored_bytes() == 0


def test_a_restore_never_completes_a_git_dir_nor_recreates_a_misleading_name(env: Env) -> None:
    (env.root / "tools").mkdir()
    (env.root / "tools" / "HEAD").write_text("ref: refs/heads/main\n")
    (env.root / "odd\nname").write_text("host\n")
    checkpoint, _ = env.checkpoint()
    env.delete("tools/HEAD", env.sha("tools/HEAD"))  # `tools` was no git dir: allowed
    env.delete("odd\nname", env.sha("odd\nname"))  # an existing name: allowed
    # The host makes `tools` hold objects/ and refs/ since: putting HEAD back would
    # complete a git dir by content.
    (env.root / "tools" / "objects").mkdir()
    (env.root / "tools" / "refs").mkdir()
    for dry_run in (True, False):
        result = env.restore(checkpoint, dry_run=dry_run)
        assert sorted((f.path, f.reason) for f in result.blocked) == [
            ("demo:odd\nname", "control_character"),
            ("demo:tools/HEAD", "git_dir"),
        ]
        assert result.restored == []
    assert not (env.root / "tools" / "HEAD").exists()
    assert not (env.root / "odd\nname").exists()


@pytest.mark.parametrize("quota", [500])
def test_writes_keep_pre_images_exactly_while_a_checkpoint_is_live(env: Env) -> None:
    """`keep` answers from memory (no query under the commit lock): a new checkpoint
    makes the next write keep its pre-image, one expired by the quota stops it, and a
    new `Checkpoints` over the same state knows which are live."""

    def kept() -> int:
        return int(env.store.query("SELECT COUNT(*) AS n FROM preimages")[0]["n"])

    env.write("a.txt", "alpha 2\n", sha("alpha\n"))
    assert kept() == 0  # no checkpoint yet
    env.checkpoint()
    env.write("a.txt", "x" * 600 + "\n", sha("alpha 2\n"))
    assert kept() == 1
    env.write("a.txt", "small\n", sha("x" * 600 + "\n"))  # 601 bytes kept: over the quota
    assert len(env.kinds("workspace.checkpoint_expired")) == 1
    before = kept()
    env.write("keep.txt", "changed\n", sha("unchanged\n"))
    assert kept() == before  # nothing live: nothing kept
    env.checkpoint()
    again = Checkpoints(env.store, env.journal, env.state, 1 << 30)
    try:
        assert again.has_live(env.ws.id)
        other = Writer(env.store, env.journal, again)
        p = WriteParams(
            workspace=env.ws.id,
            path="keep.txt",
            content="changed 2\n",
            base_sha256=sha("changed\n"),
        )
        other.write(env.ws, write_request(p), ACTOR)
        assert kept() == before + 1
    finally:
        again.close()
