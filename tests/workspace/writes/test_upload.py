"""substrate.workspace.writes.upload in-process: an upload is written as `fs.write` would
write its bytes (same checks, same plan digest, atomic), streamed from its spool."""

from __future__ import annotations

import hashlib
import os
import stat
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.config import Config
from substrate.errors import (
    AlreadyExists,
    ApprovalRequired,
    NotFound,
    PathDenied,
    PathInvalid,
    PlanMismatch,
    StaleBase,
    SymlinkRefused,
    TooLarge,
    UploadMismatch,
)
from substrate.schema.fs import Plan, WriteParams, write_request
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.checkpoints import Checkpoints
from substrate.workspace.digests import Digests
from substrate.workspace.registry import TEMP_PREFIX, Workspace, WorkspaceRegistry
from substrate.workspace.uploads import SPOOL_DIR, Upload, Uploads
from substrate.workspace.writes import UploadWriter, Writer, upload
from tests.harness.workspaces import WORKSPACE_UID

ACTOR = "agent:0"
FILES: dict[str, str | bytes] = {
    "README.md": "# demo\n\nhello\n",
    "ci/deploy.yml": "steps: []\n",
    "tool.sh": "#!/bin/sh\necho hi\n",
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Env:
    root: Path
    state: Path
    ws: Workspace
    store: Store
    journal: Journal
    registry: WorkspaceRegistry
    uploads: Uploads
    writer: UploadWriter
    checkpoints: Checkpoints

    def upload(
        self, path: str, data: bytes, base: str | None, *, declared: str | None = None, **kw: Any
    ) -> Upload:
        self.writer.check(self.ws, path, base, kw.get("create_parents", False))
        up = self.uploads.begin(
            ACTOR,
            workspace=self.ws.id,
            path=path,
            base_sha256=base,
            size=len(data),
            sha256=declared or sha(data),
            mode=kw.get("mode"),
            create_parents=kw.get("create_parents", False),
        )
        step = 1 << 20
        for offset in range(0, len(data), step):
            self.uploads.chunk(ACTOR, up.id, offset, data[offset : offset + step])
        return up

    def commit(self, up: Upload, *, dry_run: bool = False, digest: str | None = None) -> Plan:
        with self.uploads.using(ACTOR, up.id):
            Uploads.check_complete(up)
            fd = self.uploads.open_spool(up)
            try:
                plan = self.writer.commit(self.ws, up, fd, dry_run, digest, ACTOR)
            finally:
                os.close(fd)
            if plan.applied:
                self.uploads.finish(up)
            return plan

    def entries(self, kind: str = "fs.upload") -> list[Any]:
        return [e for e in self.journal.read(limit=10000) if e.kind == kind]


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    root = make_workspace("demo", FILES)
    os.chmod(root / "tool.sh", 0o750)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    registry = WorkspaceRegistry(config, store, journal, state)
    ws = registry.adopt(str(root), None, Policy(require_approval=["ci/**"]), ACTOR)
    checkpoints = Checkpoints(store, journal, state, 1 << 30)
    uploads = Uploads(state, max_bytes=1 << 30, max_open=8, idle_s=600.0)
    writer = UploadWriter(store, journal, Digests(), checkpoints)
    try:
        yield Env(root, state, ws, store, journal, registry, uploads, writer, checkpoints)
    finally:
        uploads.close()
        checkpoints.close()
        registry.close()
        store.close()


def temp_files(root: Path) -> list[str]:
    return [
        n for _d, dirs, files in os.walk(root) for n in dirs + files if n.startswith(TEMP_PREFIX)
    ]


def test_create_lands_whole_owned_by_the_workspace_and_journaled_without_bytes(env: Env) -> None:
    data = os.urandom(3 << 20)
    up = env.upload("out/big.bin", data, None, create_parents=True)
    plan = env.commit(up)
    assert plan.applied and plan.op == "create" and plan.size == len(data)
    assert plan.new_sha256 == sha(data) and plan.base_sha256 is None
    target = env.root / "out" / "big.bin"
    assert target.read_bytes() == data
    st = target.stat()
    assert stat.S_IMODE(st.st_mode) == 0o644
    if os.geteuid() == 0:
        assert (st.st_uid, (env.root / "out").stat().st_uid) == (WORKSPACE_UID, WORKSPACE_UID)
    (entry,) = env.entries()
    assert entry.data == {
        "path": "demo:out/big.bin",
        "op": "create",
        "base_sha256": None,
        "new_sha256": sha(data),
        "size": len(data),
        "mode": 0o644,
        "plan_digest": plan.plan_digest,
        "approval_id": None,
        "upload": up.id,
    }
    assert temp_files(env.root) == []
    assert os.listdir(env.state / SPOOL_DIR) == []


def test_the_plan_is_the_one_fs_write_would_make(env: Env) -> None:
    data = b"# demo\n\nhello, uploaded\n"
    base = sha((env.root / "README.md").read_bytes())
    fs_plan = Writer(env.store, env.journal).write(
        env.ws,
        write_request(
            WriteParams(
                workspace=env.ws.id,
                path="README.md",
                base_sha256=base,
                content=data.decode(),
                dry_run=True,
            )
        ),
        ACTOR,
    )
    up = env.upload("README.md", data, base)
    dry = env.commit(up, dry_run=True)
    assert dry == fs_plan
    assert "+hello, uploaded" in dry.diff
    assert (env.root / "README.md").read_bytes() == FILES["README.md"].encode()  # type: ignore[union-attr]
    applied = env.commit(up, digest=dry.plan_digest)
    assert applied.applied and applied.plan_digest == fs_plan.plan_digest
    assert (env.root / "README.md").read_bytes() == data


def test_replace_keeps_mode_and_owner(env: Env) -> None:
    path = env.root / "tool.sh"
    up = env.upload("tool.sh", b"#!/bin/sh\necho bye\n", sha(path.read_bytes()))
    plan = env.commit(up)
    assert plan.op == "replace" and plan.mode == 0o750
    assert stat.S_IMODE(path.stat().st_mode) == 0o750
    if os.geteuid() == 0:
        assert path.stat().st_uid == WORKSPACE_UID


def test_set_id_bits_are_dropped(env: Env) -> None:
    up = env.upload("x.bin", b"x", None, mode=0o6755)
    assert env.commit(up).mode == 0o755


@pytest.mark.parametrize(
    ("path", "base", "refusal"),
    [
        ("README.md", None, AlreadyExists),
        ("README.md", "0" * 64, StaleBase),
        ("missing/x.bin", None, NotFound),
        (".git/config", None, PathDenied),
        (TEMP_PREFIX + "x", None, PathDenied),
        ("link/x.bin", None, SymlinkRefused),
    ],
)
def test_begin_refuses_what_fs_write_refuses(
    env: Env, path: str, base: str | None, refusal: type[Exception]
) -> None:
    (env.root / "link").symlink_to("/tmp")
    (env.root / ".git").mkdir(exist_ok=True)
    with pytest.raises(refusal):
        env.writer.check(env.ws, path, base, False)


def test_an_upload_never_completes_a_git_dir_nor_makes_a_misleading_name(env: Env) -> None:
    (env.root / "lib" / "objects").mkdir(parents=True)
    (env.root / "lib" / "HEAD").write_text("ref: refs/heads/main\n")
    with pytest.raises(PathDenied) as caught:
        env.writer.check(env.ws, "lib/refs/x", None, True)
    assert caught.value.data == {"reason": "git_dir", "git_dir": "lib"}
    (env.root / "tools" / "objects").mkdir(parents=True)
    with pytest.raises(PathInvalid) as invalid:
        env.writer.check(env.ws, "notes\u202etxt.sh", None, False)
    assert invalid.value.data["reason"] == "bidi_control"
    # Begun while `tools` lacked `refs`; the host made it before the commit: refused then.
    up = env.upload("tools/HEAD", b"ref: refs/heads/main\n", None)
    (env.root / "tools" / "refs").mkdir()
    with pytest.raises(PathDenied) as caught:
        env.commit(up)
    assert caught.value.data["reason"] == "git_dir"
    assert not (env.root / "tools" / "HEAD").exists()
    assert env.entries() == [] and temp_files(env.root) == []


def test_a_change_on_the_host_after_begin_is_stale_at_commit_and_kept(env: Env) -> None:
    readme = env.root / "README.md"
    up = env.upload("README.md", b"agent's bytes\n", sha(readme.read_bytes()))
    readme.write_bytes(b"the person's edit\n")
    with pytest.raises(StaleBase) as info:
        env.commit(up)
    assert info.value.data == {"current_sha256": sha(b"the person's edit\n")}
    assert readme.read_bytes() == b"the person's edit\n"
    assert env.entries() == []
    assert temp_files(env.root) == []
    assert env.uploads.count() == 1  # a refusal leaves the upload open


def test_plan_mismatch_and_approval(env: Env) -> None:
    deploy = env.root / "ci" / "deploy.yml"
    up = env.upload("ci/deploy.yml", b"steps: [deploy]\n", sha(deploy.read_bytes()))
    with pytest.raises(PlanMismatch):
        env.commit(up, digest="1" * 64)
    dry = env.commit(up, dry_run=True)  # a dry run shows the plan to approve
    with pytest.raises(ApprovalRequired) as info:
        env.commit(up)
    assert info.value.data == {"plan_digest": dry.plan_digest}
    approval, _ = env.registry.grant_approval(env.ws, dry.plan_digest, 60, "operator:0")
    plan = env.commit(up)
    assert plan.applied and deploy.read_bytes() == b"steps: [deploy]\n"
    assert env.entries()[0].data["approval_id"] == approval


def test_spool_bytes_changed_after_they_arrived_are_a_mismatch(env: Env) -> None:
    up = env.upload("new.bin", b"a" * 5000, None)
    (env.state / SPOOL_DIR / up.id).write_bytes(b"b" * 5000)
    with pytest.raises(UploadMismatch):
        env.commit(up)
    assert not (env.root / "new.bin").exists()
    assert temp_files(env.root) == []


def test_a_live_checkpoint_keeps_what_the_upload_replaces(env: Env) -> None:
    readme = env.root / "README.md"
    old = readme.read_bytes()
    env.checkpoints.create(env.ws, ACTOR)
    env.commit(env.upload("README.md", b"new\n", sha(old)))
    assert env.checkpoints.read_blob(sha(old), 1 << 20) == old


def test_a_file_too_large_to_keep_for_a_checkpoint_is_refused(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upload, "MAX_PATCH_FILE", 8)
    readme = env.root / "README.md"
    up = env.upload("README.md", b"new\n", sha(readme.read_bytes()))  # no checkpoint yet
    env.checkpoints.create(env.ws, ACTOR)
    with pytest.raises(TooLarge):
        env.commit(up)
    with pytest.raises(TooLarge):
        env.writer.check(env.ws, "README.md", sha(readme.read_bytes()), False)
    assert readme.read_bytes() == FILES["README.md"].encode()  # type: ignore[union-attr]


def test_commit_memory_stays_at_a_block(env: Env) -> None:
    """Neither the spool nor the file it replaces is read whole (the copy is streamed)."""
    size = 24 << 20
    with open(env.root / "big.bin", "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))
    base = sha((env.root / "big.bin").read_bytes())
    new = os.urandom(size)
    up = env.upload("big.bin", new, base)
    del new
    tracemalloc.start()
    try:
        plan = env.commit(up)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert plan.applied
    assert peak < 6 << 20, peak
