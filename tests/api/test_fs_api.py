"""`fs.*` through a real daemon: huge files, explicit hashes, names that are not UTF-8.

Huge files are sparse (`truncate`): 20 GB each, no disk used, and a whole-file hash of one
takes a minute. The tests prove that such files never cost a reader thread that long:
stats and reads answer without their digest (`sha256_deferred`), and digests asked for
explicitly run beside, not instead of, small reads.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from substrate.protocol.client import RpcError
from tests.harness import wait_until_async

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

GiB = 1 << 30
MiB = 1 << 20
PATIENCE_S = 120.0  # a hang guard only: on the old code every huge stat took ~80 s


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def sparse(path: Path, size: int = 20 * GiB) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def bytes_read(pid: int) -> int:
    """How many bytes the process has read so far (`rchar`, all its threads)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/<pid>/io")


async def test_huge_files_answer_without_their_digest(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    """18 stats and 18 reads of 20 GB files at once, and small reads among them."""
    d = daemon_factory()
    root = d.make_workspace(files={"a.txt": "alpha\n"})
    names = [f"huge{i}.img" for i in range(18)]
    for name in names:
        sparse(root / name)
    ws = d.adopt(root)
    results: list[tuple[str, dict[str, Any]]] = []

    async with d.async_client() as c:

        async def call(method: str, path: str) -> None:
            results.append((method, await c.call(method, workspace=ws, path=path)))

        with trio.fail_after(PATIENCE_S):
            async with trio.open_nursery() as nursery:
                for name in names:
                    nursery.start_soon(call, "fs.stat", name)
                    nursery.start_soon(call, "fs.read", name)
                    nursery.start_soon(call, "fs.read", "a.txt")

    huge = [r for _, r in results if r.get("size") == 20 * GiB]
    assert len(huge) == 36
    assert all(r.get("sha256") is None and r["sha256_deferred"] is True for r in huge)
    small = [r for _, r in results if r.get("data") == "alpha\n"]
    assert len(small) == 18
    assert all(r["sha256"] == sha("alpha\n") and "sha256_deferred" not in r for r in small)


async def test_small_reads_are_served_while_big_hashes_run(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory()
    root = d.make_workspace(files={"a.txt": "alpha\n", "src/b.txt": "beta\n"})
    for i in range(4):
        sparse(root / f"huge{i}.img")
    ws = d.adopt(root)
    pending: set[str] = set()

    async with d.async_client() as hasher, d.async_client() as reader:

        async def hash_one(name: str) -> None:
            pending.add(name)
            await hasher.call("fs.stat", workspace=ws, path=name, hash=True)
            pending.discard(name)

        with trio.fail_after(PATIENCE_S):
            async with trio.open_nursery() as nursery:
                before = bytes_read(d.pid)
                for i in range(4):
                    nursery.start_soon(hash_one, f"huge{i}.img")
                # The hashes are running once the daemon has read a good part of a file.
                await wait_until_async(
                    lambda: bytes_read(d.pid) >= before + 256 * MiB, PATIENCE_S, interval=0.01
                )
                for _ in range(20):
                    got = await reader.call("fs.read", workspace=ws, path="a.txt")
                    assert got["sha256"] == sha("alpha\n")
                    got = await reader.call("fs.stat", workspace=ws, path="src/b.txt")
                    assert got["sha256"] == sha("beta\n")
                listed = await reader.call("fs.list", workspace=ws)
                assert len(listed["entries"]) == 6
                # All that while, the big hashes were still going.
                assert pending
                nursery.cancel_scope.cancel()


def test_a_deferred_digest_is_given_on_request_and_binds_a_write(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(inline_hash_bytes=MiB)
    body = os.urandom(3 * MiB)
    root = d.make_workspace(files={"big.bin": body})
    ws = d.adopt(root)
    with d.client() as c:
        st = c.call("fs.stat", workspace=ws, path="big.bin")
        assert "sha256" not in st and st["sha256_deferred"] is True
        got = c.call("fs.read", workspace=ws, path="big.bin", length=16)
        assert got["sha256"] is None and got["sha256_deferred"] is True
        assert base64.b64decode(got["data"]) == body[:16]

        st = c.call("fs.stat", workspace=ws, path="big.bin", hash=True)
        assert st["sha256"] == sha(body) and "sha256_deferred" not in st
        got = c.call("fs.read", workspace=ws, path="big.bin", length=16, hash=True)
        assert got["sha256"] == sha(body)

        new = b"replaced\n"
        plan = c.call(
            "fs.write",
            workspace=ws,
            path="big.bin",
            content_b64=base64.b64encode(new).decode(),
            base_sha256=st["sha256"],
        )
        assert plan["applied"] and (root / "big.bin").read_bytes() == new
        with pytest.raises(RpcError) as info:
            c.call("fs.write", workspace=ws, path="big.bin", content="x", base_sha256=sha(body))
        assert info.value.refusal == "stale_base"


def test_names_that_are_not_utf8_are_listed_walked_and_searched(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory()
    root = d.make_workspace(files={"a.txt": "alpha\n"})
    base = os.fsencode(root)
    os.mkdir(base + b"/d\xff")
    with open(base + b"/d\xff/caf\xe9.txt", "wb") as f:
        f.write(b"needle\n")
    os.chown(base + b"/d\xff", 1000, 1000)
    os.chown(base + b"/d\xff/caf\xe9.txt", 1000, 1000)
    ws = d.adopt(root)

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    with d.client() as c:
        entries = c.call("fs.list", workspace=ws)["entries"]
        assert {
            "name": "d\\xff",
            "kind": "dir",
            "size": os.stat(base + b"/d\xff").st_size,
            "name_b64": b64(b"d\xff"),
        } in entries
        assert {"name": "a.txt", "kind": "file", "size": 6} in entries
        walked = c.call("fs.walk", workspace=ws)["paths"]
        assert {
            "path": "d\\xff/caf\\xe9.txt",
            "kind": "file",
            "size": 7,
            "path_b64": b64(b"d\xff/caf\xe9.txt"),
        } in walked
        matches = c.call("fs.search", workspace=ws, pattern="needle")["matches"]
        assert matches == [
            {
                "path": "d\\xff/caf\\xe9.txt",
                "path_b64": b64(b"d\xff/caf\xe9.txt"),
                "line": 1,
                "column": 1,
                "text": "needle",
            }
        ]
