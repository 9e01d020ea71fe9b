"""Chunked uploads through a real daemon (docs/protocol.md §14): a 50 MiB file lands whole
and atomically, an interrupted upload leaves nothing behind, every cap has its refusal."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import substrate
from substrate.protocol.client import Client, RpcError
from substrate.workspace.uploads import SPOOL_DIR
from substrate.workspace.writes import TEMP_PREFIX
from tests.harness.waiting import wait_until

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

MiB = 1 << 20


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_random(path: Path, size: int) -> str:
    """`size` random bytes at `path`, a MiB at a time; their SHA-256."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for _ in range(size // MiB):
            block = os.urandom(MiB)
            h.update(block)
            f.write(block)
    return h.hexdigest()


def file_sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def spool(d: DaemonProcess) -> list[str]:
    return sorted(os.listdir(d.state_dir / SPOOL_DIR))


def begin(c: Client, ws: str, path: str, data: bytes, base: str | None = None, **kw: Any) -> str:
    params = {"base_sha256": base, "size": len(data), "sha256": sha(data), **kw}
    return str(c.call("fs.upload.begin", workspace=ws, path=path, **params)["upload"])


def chunk(c: Client, upload: str, offset: int, data: bytes) -> Any:
    return c.call(
        "fs.upload.chunk", upload=upload, offset=offset, data_b64=base64.b64encode(data).decode()
    )


def refusal(call: Callable[[], Any]) -> RpcError:
    with pytest.raises(RpcError) as info:
        call()
    return info.value


@pytest.mark.slow
def test_a_50_mib_upload_replaces_the_file_whole_and_atomically(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    old = os.urandom(MiB) * 50  # 50 MiB on the host already
    root = daemon.make_workspace("big", {"data/big.bin": old, "README.md": "hi\n"})
    ws = daemon.adopt(root)
    source = tmp_path / "new.bin"
    new_sha = write_random(source, 50 * MiB)
    target = root / "data" / "big.bin"
    inode = target.stat().st_ino
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        # Every whole read of the target, during the upload and its commit, is the old
        # file or the new one: never a mix, never a partial file.
        while not stop.is_set():
            seen.add(file_sha(target))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with daemon.client() as c:
            plan = c.upload_file(ws, "data/big.bin", source, base_sha256=sha(old))
    finally:
        stop.set()
        watcher.join(60)
    assert plan["applied"] and plan["op"] == "replace"
    assert plan["new_sha256"] == new_sha and plan["size"] == 50 * MiB
    assert plan["base_sha256"] == sha(old)
    assert file_sha(target) == new_sha
    assert target.stat().st_ino != inode  # renamed over, not written in place
    assert seen <= {sha(old), new_sha} and sha(old) in seen
    assert [p.name for p in root.rglob(TEMP_PREFIX + "*")] == []
    assert spool(daemon) == []
    (entry,) = daemon.journal({"fs.upload"})
    assert entry["data"]["new_sha256"] == new_sha and entry["data"]["size"] == 50 * MiB
    # Digests and sizes only: no bytes of the file in the journal, in any encoding.
    text = json.dumps(daemon.journal())
    with open(source, "rb") as f:
        head = f.read(48)
    for needle in (base64.b64encode(head).decode()[:32], head.hex()[:32]):
        assert needle not in text
    replay = daemon.client().call("journal.replay", workspace=ws)
    assert {f["path"]: f["status"] for f in replay["files"]}["big:data/big.bin"] == "match"


def test_an_interrupted_upload_leaves_nothing_and_its_spool_goes_at_restart(
    daemon_factory: Callable[..., DaemonProcess], snapshot_tree: Callable[[Path], Any]
) -> None:
    d = daemon_factory()
    root = d.make_workspace("demo", {"a.txt": "a\n"})
    ws = d.adopt(root)
    before = snapshot_tree(root)
    data = os.urandom(3 * MiB)
    c = d.client()
    upload = begin(c, ws, "new.bin", data)
    chunk(c, upload, 0, data[: MiB // 2])
    chunk(c, upload, MiB // 2, data[MiB // 2 : MiB])
    c.close()  # the connection drops mid-way
    assert spool(d) == [upload]
    assert snapshot_tree(root) == before
    d.kill()  # and the daemon goes down with it
    d.start()
    assert spool(d) == []
    assert snapshot_tree(root) == before
    with d.client() as again:
        resumed = refusal(lambda: chunk(again, upload, MiB, data[MiB : MiB + 100]))
        assert resumed.refusal == "upload_unknown"
        assert refusal(lambda: again.call("fs.upload.commit", upload=upload)).refusal == (
            "upload_unknown"
        )
    assert snapshot_tree(root) == before


def test_a_stopping_daemon_removes_its_spools(
    daemon_factory: Callable[..., DaemonProcess], snapshot_tree: Callable[[Path], Any]
) -> None:
    d = daemon_factory()
    root = d.make_workspace("demo", {"a.txt": "a\n"})
    ws = d.adopt(root)
    before = snapshot_tree(root)
    with d.client() as c:
        upload = begin(c, ws, "new.bin", b"x" * 1000)
        chunk(c, upload, 0, b"x" * 500)
    assert spool(d) == [upload]
    assert d.stop() == 0
    assert spool(d) == []
    assert snapshot_tree(root) == before


def test_a_dropped_connection_resumes_where_it_stopped(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("demo", {"a.txt": "a\n"})
    ws = daemon.adopt(root)
    half = MiB // 2
    data = os.urandom(3 * half + 5)
    c = daemon.client()
    upload = begin(c, ws, "new.bin", data)
    chunk(c, upload, 0, data[:half])
    c.close()
    with daemon.client() as again:  # same socket and uid: the same caller
        assert chunk(again, upload, 0, data[:half])["received"] == half  # a retry: no-op
        for offset in range(half, len(data), half):
            chunk(again, upload, offset, data[offset : offset + half])
        plan = again.call("fs.upload.commit", upload=upload)
    assert plan["applied"] and (root / "new.bin").read_bytes() == data
    assert spool(daemon) == []


def test_idle_uploads_expire_and_their_spool_is_removed(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(upload_idle_s=0.5)
    root = d.make_workspace("demo", {"a.txt": "a\n"})
    ws = d.adopt(root)
    with d.client() as c:
        upload = begin(c, ws, "new.bin", b"x" * 100)
        chunk(c, upload, 0, b"x" * 10)
        assert spool(d) == [upload]
        wait_until(lambda: spool(d) == [], 30)
        assert refusal(lambda: chunk(c, upload, 10, b"x" * 10)).refusal == "upload_unknown"
    assert not (root / "new.bin").exists()


def test_refusals(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(max_upload_bytes=4 * MiB, max_uploads=2)
    root = d.make_workspace("demo", {"a.txt": "a\n"})
    ws = d.adopt(root)
    data = b"0123456789" * 1000
    with d.client() as c, d.client() as second:
        too_big = refusal(lambda: begin(c, ws, "big.bin", b"", size=4 * MiB + 1))
        assert (too_big.refusal, too_big.data["limit"]) == ("too_large", 4 * MiB)
        exists = refusal(lambda: begin(c, ws, "a.txt", data))
        assert exists.refusal == "already_exists"
        stale = refusal(lambda: begin(c, ws, "a.txt", data, base="0" * 64))
        assert (stale.refusal, stale.data["current_sha256"]) == ("stale_base", sha(b"a\n"))

        upload = begin(c, ws, "new.bin", data)
        gap = refusal(lambda: chunk(c, upload, 10, data[10:20]))
        assert (gap.refusal, gap.data["received"]) == ("upload_conflict", 0)
        chunk(c, upload, 0, data[:5000])
        differs = refusal(lambda: chunk(c, upload, 0, b"x" * 100))
        assert differs.refusal == "upload_conflict"
        past = refusal(lambda: chunk(c, upload, 5000, data[5000:] + b"!"))
        assert past.refusal == "upload_conflict"
        bad_b64 = refusal(
            lambda: c.call("fs.upload.chunk", upload=upload, offset=5000, data_b64="***")
        )
        assert (bad_b64.refusal, bad_b64.data["path"]) == ("invalid_params", "$.data_b64")
        early = refusal(lambda: c.call("fs.upload.commit", upload=upload))
        assert (early.refusal, early.data) == (
            "upload_incomplete",
            {"refusal": "upload_incomplete", "received": 5000, "size": len(data)},
        )
        unknown = refusal(lambda: c.call("fs.upload.commit", upload="upl_" + "0" * 32))
        assert unknown.refusal == "upload_unknown"

        wrong = begin(c, ws, "wrong.bin", data, sha256="f" * 64)
        chunk(c, wrong, 0, data)
        mismatch = refusal(lambda: c.call("fs.upload.commit", upload=wrong))
        assert mismatch.refusal == "upload_mismatch"
        assert mismatch.data["received_sha256"] == sha(data)
        # Two are open: a third is over `max_uploads`.
        third = refusal(lambda: begin(c, ws, "third.bin", data))
        assert (third.refusal, third.data["scope"]) == ("limit_exceeded", "uploads")
        assert c.call("fs.upload.abort", upload=wrong)["received"] == len(data)
        begin(second, ws, "third.bin", data)
    assert sorted(p.name for p in root.iterdir()) == ["a.txt"]
    refused = [e["data"]["refusal"] for e in d.journal({"refusal"})]
    assert "upload_mismatch" in refused and "upload_incomplete" in refused


def test_stale_base_at_commit_keeps_the_hosts_edit(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("demo", {"a.txt": "a\n"})
    ws = daemon.adopt(root)
    data = b"agent's version\n"
    with daemon.client() as c:
        upload = begin(c, ws, "a.txt", data, base=sha(b"a\n"))
        chunk(c, upload, 0, data)
        (root / "a.txt").write_bytes(b"a person's edit\n")
        stale = refusal(lambda: c.call("fs.upload.commit", upload=upload))
        assert (stale.refusal, stale.data["current_sha256"]) == (
            "stale_base",
            sha(b"a person's edit\n"),
        )
        assert (root / "a.txt").read_bytes() == b"a person's edit\n"
        # The upload stays open (a refusal changes nothing) until aborted.
        assert c.call("fs.upload.abort", upload=upload)["received"] == len(data)
    assert daemon.journal({"fs.upload"}) == []


def test_dry_run_and_plan_digest(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("demo", {"a.txt": "a\n"})
    ws = daemon.adopt(root)
    data = b"a\nb\n"
    with daemon.client() as c:
        upload = begin(c, ws, "a.txt", data, base=sha(b"a\n"))
        chunk(c, upload, 0, data)
        dry = c.call("fs.upload.commit", upload=upload, dry_run=True)
        assert not dry["applied"] and "+b" in dry["diff"]
        assert (root / "a.txt").read_bytes() == b"a\n"
        plan = c.call("fs.upload.commit", upload=upload, plan_digest=dry["plan_digest"])
    assert plan["applied"] and plan["plan_digest"] == dry["plan_digest"]
    assert (root / "a.txt").read_bytes() == data


def test_cli_write_of_a_big_file_goes_by_upload(daemon: DaemonProcess, tmp_path: Path) -> None:
    root = daemon.make_workspace("demo", {"a.txt": "a\n"})
    ws = daemon.adopt(root)
    source = tmp_path / "big.bin"
    new_sha = write_random(source, 3 * MiB)  # over one request line as base64
    argv = [sys.executable, "-m", "substrate", "--state-dir", str(daemon.state_dir), "write"]
    env = {**os.environ, "PYTHONPATH": str(Path(substrate.__file__).resolve().parent.parent)}
    done = subprocess.run(
        [*argv, "big.bin", "--workspace", ws, "--create", "--from", str(source)],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["new_sha256"] == new_sha
    assert file_sha(root / "big.bin") == new_sha
    assert [e["data"]["new_sha256"] for e in daemon.journal({"fs.upload"})] == [new_sha]
