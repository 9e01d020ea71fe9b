"""`workspace.checkpoint` / `workspace.restore` end to end through the agent socket
(docs/protocol.md §11), across a daemon restart."""

from __future__ import annotations

import base64
import hashlib
import os
import sqlite3
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from substrate.protocol.client import Client, RpcError

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

MARKER = "preimage-bytes-c41d"
FILES: dict[str, str | bytes] = {
    "a.txt": f"alpha {MARKER}\n",
    "tool.sh": "#!/bin/sh\necho old\n",
    "old.txt": "delete me\n",
    "host.txt": "before\n",
}


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    out: dict[str, tuple[bytes, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = (path.read_bytes(), mode(path))
    return out


def rels(result: dict[str, Any], name: str) -> list[str]:
    return sorted(f["path"].split(":", 1)[1] for f in result[name])


def writes(c: Client, ws: str, root: Path) -> None:
    """fs.write (a create and a replace with a new mode), fs.patch, fs.delete, and a host
    edit after substrate wrote host.txt."""
    c.call(
        "fs.write",
        workspace=ws,
        path="sub/new.bin",
        content_b64=base64.b64encode(b"\x00new\xff").decode(),
        base_sha256=None,
        create_parents=True,
    )
    c.call(
        "fs.write",
        workspace=ws,
        path="a.txt",
        content="alpha 2\n",
        base_sha256=sha(f"alpha {MARKER}\n"),
        mode=0o600,
    )
    c.call(
        "fs.patch",
        workspace=ws,
        path="tool.sh",
        base_sha256=sha("#!/bin/sh\necho old\n"),
        edits=[{"old": "old", "new": "new"}],
    )
    c.call("fs.delete", workspace=ws, path="old.txt", base_sha256=sha("delete me\n"))
    c.call("fs.write", workspace=ws, path="host.txt", content="ours\n", base_sha256=sha("before\n"))
    (root / "host.txt").write_text("a person's edit\n")


def test_checkpoint_and_restore_through_the_socket(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("proj", FILES, git=True)
    (root / "tool.sh").chmod(0o755)
    before = tree(root)
    ws = daemon.adopt(root)
    with daemon.client() as c:
        made = c.call("workspace.checkpoint", workspace=ws)
        checkpoint = made["checkpoint"]
        writes(c, ws, root)
        edited = tree(root)

        dry = c.call("workspace.restore", workspace=ws, checkpoint=checkpoint, dry_run=True)
        assert tree(root) == edited  # a dry run changes nothing
        assert dry["dry_run"] is True
        assert rels(dry, "restored") == ["a.txt", "old.txt", "sub/new.bin", "tool.sh"]

        result = c.call("workspace.restore", workspace=ws, checkpoint=checkpoint)

    assert result["seq"] == made["seq"] and result["dry_run"] is False
    assert rels(result, "restored") == ["a.txt", "old.txt", "sub/new.bin", "tool.sh"]
    assert result["counts"] == {
        "restored": 4,
        "unchanged": 0,
        "conflicts": 1,
        "blocked": 0,
        "pending": 0,
    }
    (conflict,) = result["conflicts"]
    assert conflict["path"].endswith(":host.txt") and conflict["reason"] == "changed_since"
    assert conflict["current_sha256"] == sha("a person's edit\n")
    # Exact bytes and modes back; the created file gone; the host's edit kept.
    after = tree(root)
    assert after.pop("host.txt") == (b"a person's edit\n", 0o644)
    before.pop("host.txt")
    assert after == before
    assert not (root / "sub" / "new.bin").exists()

    (entry,) = daemon.journal(kinds={"workspace.checkpoint"})
    assert entry["seq"] == made["seq"] and entry["workspace"] == ws
    (summary,) = daemon.journal(kinds={"workspace.restore"})
    assert summary["data"]["restored"] == 4 and summary["data"]["conflicts"] == 1
    assert len(daemon.journal(kinds={"workspace.restore_file"})) == 4

    # The checkpoint and its pre-images outlive a restart; a second restore changes nothing.
    restored = tree(root)
    daemon.restart()
    with daemon.client() as c:
        (info,) = c.call("workspace.list")["workspaces"]
        assert info["workspace"] == ws
        again = c.call("workspace.restore", workspace=ws, checkpoint=checkpoint)
    assert again["restored"] == [] and again["counts"]["unchanged"] == 4
    assert rels(again, "conflicts") == ["host.txt"]
    assert tree(root) == restored
    assert len(daemon.journal(kinds={"workspace.restore_file"})) == 4
    assert daemon.verify_journal()["ok"] is True


def test_unknown_checkpoint_is_refused_and_journaled(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("proj", FILES)
    ws = daemon.adopt(root)
    with daemon.client() as c, pytest.raises(RpcError) as info:
        c.call("workspace.restore", workspace=ws, checkpoint="ckp_0123456789abcdef")
    assert info.value.code == -32001 and info.value.refusal == "checkpoint_unknown"
    (refused,) = daemon.journal(kinds={"refusal"}, workspace=ws)
    assert refused["data"] == {"method": "workspace.restore", "refusal": "checkpoint_unknown"}


def test_preimage_bytes_never_reach_the_journal_table(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("proj", FILES)
    ws = daemon.adopt(root)
    with daemon.client() as c:
        checkpoint = c.call("workspace.checkpoint", workspace=ws)["checkpoint"]
        c.call("fs.delete", workspace=ws, path="a.txt", base_sha256=sha(f"alpha {MARKER}\n"))
        c.call("workspace.restore", workspace=ws, checkpoint=checkpoint)
    assert (root / "a.txt").read_text() == f"alpha {MARKER}\n"
    db = sqlite3.connect(f"file:{daemon.state_dir / 'substrate.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT kind, data FROM journal").fetchall()
    finally:
        db.close()
    assert any(kind == "workspace.restore_file" for kind, _ in rows)
    assert not any(MARKER in data for _, data in rows)
    digest = sha(f"alpha {MARKER}\n")
    blob = daemon.state_dir / "preimages" / digest[:2] / digest[2:]
    assert blob.read_text() == f"alpha {MARKER}\n"
