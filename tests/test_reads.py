"""substrate.workspace.reads in-process: stat, read, list, walk and search on a real temp workspace."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import re
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import pytest

from substrate.config import Config
from substrate.errors import (
    InvalidParams,
    NotADirectory,
    NotAFile,
    NotFound,
    PathDenied,
    PathInvalid,
    SymlinkRefused,
    TooLarge,
    UnknownWorkspace,
)
from substrate.schema.fs import (
    MAX_READ,
    ListEntry,
    ListParams,
    ReadParams,
    SearchMatch,
    SearchParams,
    StatParams,
    StatResult,
    WalkEntry,
    WalkParams,
)
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import reads
from substrate.workspace.registry import TEMP_PREFIX, Workspace, WorkspaceRegistry

WS = "ws_test"

FILES: dict[str, str | bytes] = {
    "README.md": "# demo\n\nhello world\n",
    "src/main.py": "import os\n\ndef main() -> None:\n    print('hello')\n\n\ndef helper():\n    return 1\n",
    "src/util.py": "VALUE = 1\nHELLO = 'Hello'\n",
    "src/pkg/deep.py": "def deep():\n    pass  # hello from deep\n",
    "docs/a.txt": "alpha\nbeta\ngamma",  # no trailing newline
    "data/blob.bin": b"hello\x00binary" + bytes(range(256)),
    "data/latin1.txt": "café hello\n".encode("latin-1"),
    "keys/id.pem": "-----BEGIN hello-----\n",
    "empty": "",
}


@pytest.fixture
def registry(adopt_root: Path, tmp_path: Path) -> Iterator[WorkspaceRegistry]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    reg = WorkspaceRegistry(config, store, Journal(store), state)
    try:
        yield reg
    finally:
        reg.close()
        store.close()


@pytest.fixture
def root(make_workspace: Callable[..., Path], tmp_path: Path) -> Path:
    path = make_workspace("demo", FILES, git=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("hello from outside\n")
    (path / "link-out").symlink_to(outside)
    (path / "link-file").symlink_to(path / "README.md")
    (path / "src" / "link-dir").symlink_to("pkg")
    return path


@pytest.fixture
def ws(registry: WorkspaceRegistry, root: Path) -> Workspace:
    return registry.adopt(str(root), None, Policy(read_deny=["*.pem"]), "agent:0")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stat_path(ws: Workspace, p: StatParams) -> StatResult:
    return reads.stat_path(ws, p, reads.Digests())


def search(ws: Workspace, pattern: str, **kw: Any) -> list[tuple[str, int, int, str]]:
    result = reads.search(ws, SearchParams(workspace=WS, pattern=pattern, **kw))
    return [(m.path, m.line, m.column, m.text) for m in result.matches]


# --- stat -----------------------------------------------------------------------------------


def test_stat_file(ws: Workspace, root: Path) -> None:
    result = stat_path(ws, StatParams(workspace=WS, path="src/main.py"))
    st = os.lstat(root / "src" / "main.py")
    assert result.path == "src/main.py"
    assert result.kind == "file"
    assert result.size == st.st_size
    assert result.mode == stat.S_IMODE(st.st_mode)
    assert result.mtime_ns == st.st_mtime_ns
    assert result.sha256 == sha((root / "src" / "main.py").read_bytes())


def test_stat_large_file_hash(ws: Workspace, root: Path) -> None:
    data = os.urandom(3 * reads.CHUNK + 17)
    (root / "big.bin").write_bytes(data)
    assert stat_path(ws, StatParams(workspace=WS, path="big.bin")).sha256 == sha(data)


def test_stat_dir_root_symlink_fifo(ws: Workspace, root: Path) -> None:
    src = stat_path(ws, StatParams(workspace=WS, path="src"))
    assert (src.kind, src.sha256) == ("dir", None)
    top = stat_path(ws, StatParams(workspace=WS, path="."))
    assert (top.path, top.kind) == (".", "dir")
    link = stat_path(ws, StatParams(workspace=WS, path="link-file"))
    assert (link.kind, link.sha256, link.size) == ("symlink", None, len(str(root / "README.md")))
    os.mkfifo(root / "fifo")
    fifo = stat_path(ws, StatParams(workspace=WS, path="fifo"))
    assert (fifo.kind, fifo.sha256) == ("other", None)


def test_stat_refusals(ws: Workspace) -> None:
    with pytest.raises(NotFound):
        stat_path(ws, StatParams(workspace=WS, path="nope"))
    with pytest.raises(SymlinkRefused):
        stat_path(ws, StatParams(workspace=WS, path="link-out/secret.txt"))
    with pytest.raises(SymlinkRefused):
        stat_path(ws, StatParams(workspace=WS, path="src/link-dir/deep.py"))
    with pytest.raises(NotADirectory):
        stat_path(ws, StatParams(workspace=WS, path="README.md/x"))
    with pytest.raises(PathDenied):
        stat_path(ws, StatParams(workspace=WS, path="keys/id.pem"))
    with pytest.raises(PathInvalid):
        stat_path(ws, StatParams(workspace=WS, path="../demo/README.md"))


# --- read -----------------------------------------------------------------------------------


def read(ws: Workspace, path: str, **kw: Any) -> Any:
    return reads.read_file(ws, ReadParams(workspace=WS, path=path, **kw), reads.Digests())


def test_read_whole_text_file(ws: Workspace, root: Path) -> None:
    data = (root / "README.md").read_bytes()
    result = read(ws, "README.md")
    assert (result.path, result.size, result.offset) == ("README.md", len(data), 0)
    assert (result.encoding, result.data, result.eof) == ("utf-8", data.decode(), True)
    assert result.sha256 == sha(data)


def test_read_slices_carry_the_whole_files_digest(ws: Workspace, root: Path) -> None:
    data = (root / "src" / "main.py").read_bytes()
    head = read(ws, "src/main.py", length=6)
    assert (head.data, head.eof, head.sha256) == ("import", False, sha(data))
    tail = read(ws, "src/main.py", offset=len(data) - 9, length=100)
    assert (tail.data, tail.eof, tail.offset) == ("return 1\n", True, len(data) - 9)
    exact = read(ws, "src/main.py", offset=len(data) - 9, length=9)
    assert exact.eof
    beyond = read(ws, "src/main.py", offset=len(data) + 10)
    assert (beyond.data, beyond.eof, beyond.size) == ("", True, len(data))
    nothing = read(ws, "src/main.py", offset=3, length=0)
    assert (nothing.data, nothing.eof, nothing.encoding) == ("", False, "utf-8")


def test_read_empty_file(ws: Workspace) -> None:
    result = read(ws, "empty")
    assert (result.data, result.eof, result.size, result.sha256) == ("", True, 0, sha(b""))


def test_read_binary_is_base64(ws: Workspace, root: Path) -> None:
    data = (root / "data" / "blob.bin").read_bytes()
    result = read(ws, "data/blob.bin")
    assert result.encoding == "base64"
    assert base64.b64decode(result.data) == data
    latin = read(ws, "data/latin1.txt")
    assert latin.encoding == "base64"


def test_a_slice_cutting_a_multibyte_character_is_base64(ws: Workspace, root: Path) -> None:
    text = "añb€c"
    (root / "u.txt").write_text(text)
    data = text.encode()
    whole = read(ws, "u.txt")
    assert (whole.encoding, whole.data) == ("utf-8", text)
    cut = read(ws, "u.txt", offset=0, length=2)  # "a" + first byte of "ñ"
    assert cut.encoding == "base64"
    assert base64.b64decode(cut.data) == data[:2]
    inner = read(ws, "u.txt", offset=2, length=4)  # second byte of "ñ", "b", two of "€"
    assert inner.encoding == "base64" and base64.b64decode(inner.data) == data[2:6]
    aligned = read(ws, "u.txt", offset=1, length=2)
    assert (aligned.encoding, aligned.data) == ("utf-8", "ñ")


def test_read_slice_across_chunk_boundaries(ws: Workspace, root: Path) -> None:
    data = os.urandom(2 * reads.CHUNK + 1000)
    (root / "big.bin").write_bytes(data)
    start = reads.CHUNK - 10
    result = read(ws, "big.bin", offset=start, length=reads.CHUNK + 50)
    assert base64.b64decode(result.data) == data[start : start + reads.CHUNK + 50]
    assert result.sha256 == sha(data) and not result.eof


def test_read_length_bound(ws: Workspace, root: Path) -> None:
    (root / "big.bin").write_bytes(b"x" * (MAX_READ + 10))
    with pytest.raises(TooLarge) as info:
        read(ws, "big.bin", length=MAX_READ + 1)
    assert info.value.data == {"limit": MAX_READ}
    result = read(ws, "big.bin", length=MAX_READ)
    assert len(result.data) == MAX_READ and not result.eof


def test_read_refusals(ws: Workspace, root: Path) -> None:
    with pytest.raises(NotAFile):
        read(ws, "src")
    with pytest.raises(SymlinkRefused):
        read(ws, "link-file")
    with pytest.raises(SymlinkRefused):
        read(ws, "link-out/secret.txt")
    with pytest.raises(PathDenied):
        read(ws, "keys/id.pem")
    with pytest.raises(NotFound):
        read(ws, "src/nope.py")
    with pytest.raises(PathInvalid):
        read(ws, ".")


def test_read_fifo_does_not_block(ws: Workspace, root: Path) -> None:
    os.mkfifo(root / "fifo")
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            read(ws, "fifo")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], NotAFile)


# --- digests: bounded, cached, computed once -------------------------------------------------

GiB = 1 << 30


def _no_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fd: int) -> str:
        raise AssertionError("a whole file was hashed")

    monkeypatch.setattr(reads, "hash_fd", refuse)


def test_a_huge_file_is_stated_and_read_without_hashing_it(
    ws: Workspace, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 20 GB sparse file: size and slices at once, the digest deferred, not computed."""
    with open(root / "huge.img", "wb") as f:
        f.truncate(20 * GiB)
        f.seek(20 * GiB - 4)
        f.write(b"end\n")
    digests = reads.Digests()
    # A small file still carries its digest, and nothing about deferral.
    small = reads.stat_path(ws, StatParams(workspace=WS, path="README.md"), digests)
    assert small.sha256 == sha((root / "README.md").read_bytes()) and not small.sha256_deferred
    assert b"sha256_deferred" not in msgspec.json.encode(small)
    _no_hashing(monkeypatch)
    st = reads.stat_path(ws, StatParams(workspace=WS, path="huge.img"), digests)
    assert (st.kind, st.size, st.sha256, st.sha256_deferred) == ("file", 20 * GiB, None, True)
    head = reads.read_file(ws, ReadParams(workspace=WS, path="huge.img", length=8), digests)
    assert (head.size, head.sha256, head.sha256_deferred) == (20 * GiB, None, True)
    assert (head.data, head.eof) == ("\0" * 8, False)
    tail = reads.read_file(
        ws, ReadParams(workspace=WS, path="huge.img", offset=20 * GiB - 4), digests
    )
    assert (tail.data, tail.eof, tail.sha256) == ("end\n", True, None)


def test_a_digest_over_the_bound_comes_when_asked_and_is_then_kept(
    ws: Workspace, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(3 * reads.CHUNK + 5)
    (root / "mid.bin").write_bytes(data)
    digests = reads.Digests(racy_ns=0)
    p = StatParams(workspace=WS, path="mid.bin")
    assert reads.stat_path(ws, p, digests, reads.CHUNK).sha256_deferred
    asked = reads.stat_path(ws, p, digests, None)
    assert (asked.sha256, asked.sha256_deferred) == (sha(data), False)
    _no_hashing(monkeypatch)
    # Known now: given within the bound, by stat and read alike, without another pass.
    assert reads.stat_path(ws, p, digests, reads.CHUNK).sha256 == sha(data)
    r = ReadParams(workspace=WS, path="mid.bin", length=4)
    assert reads.read_file(ws, r, digests, reads.CHUNK).sha256 == sha(data)
    # Another version (here: another size) is another digest, not the kept one.
    with open(root / "mid.bin", "ab") as f:
        f.write(b"more")
    assert reads.stat_path(ws, p, digests, reads.CHUNK).sha256_deferred


def test_a_digest_of_a_file_changed_just_now_is_not_kept(
    ws: Workspace, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within the racy window a same-size change could keep the times: recompute instead."""
    (root / "fresh.bin").write_bytes(os.urandom(2 * reads.CHUNK))
    digests = reads.Digests(racy_ns=3600 * 10**9)
    p = StatParams(workspace=WS, path="fresh.bin")
    assert reads.stat_path(ws, p, digests, None).sha256 is not None
    assert reads.stat_path(ws, p, digests, reads.CHUNK).sha256_deferred


def test_concurrent_askers_share_one_hash(
    ws: Workspace, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(2 * reads.CHUNK)
    (root / "shared.bin").write_bytes(data)
    real_hash = reads.hash_fd
    hashing, release, waiting = threading.Event(), threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_hash(fd: int) -> str:
        calls.append(fd)
        hashing.set()
        assert release.wait(30)
        return real_hash(fd)

    class WatchedFuture(Future[Any]):
        def result(self, timeout: float | None = None) -> Any:
            waiting.set()
            return super().result(timeout)

    monkeypatch.setattr(reads, "hash_fd", slow_hash)
    monkeypatch.setattr(reads, "Future", WatchedFuture)
    digests = reads.Digests()
    p = StatParams(workspace=WS, path="shared.bin")
    results: list[str | None] = []

    def ask() -> None:
        results.append(reads.stat_path(ws, p, digests, None).sha256)

    first = threading.Thread(target=ask)
    first.start()
    assert hashing.wait(30)
    second = threading.Thread(target=ask)
    second.start()
    assert waiting.wait(30)  # the second asker waits for the first one's hash
    release.set()
    first.join(30)
    second.join(30)
    assert results == [sha(data), sha(data)] and len(calls) == 1


def test_the_digest_cache_is_bounded(root: Path) -> None:
    digests = reads.Digests(entries=3, racy_ns=0)
    for i in range(6):
        (root / f"f{i}").write_bytes(b"%d" % i)
        fd = os.open(root / f"f{i}", os.O_RDONLY)
        try:
            digests.of(fd, None)
        finally:
            os.close(fd)
    assert len(digests._known) == 3
    assert [digests.known(os.stat(root / f"f{i}")) is not None for i in range(6)] == [
        False,
        False,
        False,
        True,
        True,
        True,
    ]


# --- release while reads are in flight ------------------------------------------------------


def _same_dir(fd: int, path: Path) -> bool:
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    here = os.stat(path)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def test_release_waits_for_a_read_in_flight(
    registry: WorkspaceRegistry, ws: Workspace, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root fd is not closed (and its number not reused) under a read that uses it."""
    inside, go = threading.Event(), threading.Event()
    real_open_regular = reads.paths.open_regular

    def paused_open(dir_fd: int, name: str, where: str, flags: int = os.O_RDONLY) -> int:
        if name == "README.md":
            inside.set()
            assert go.wait(30)
        return real_open_regular(dir_fd, name, where, flags)

    monkeypatch.setattr(reads.paths, "open_regular", paused_open)
    outcome: list[Any] = []
    reader = threading.Thread(target=lambda: outcome.append(read(ws, "README.md")))
    reader.start()
    assert inside.wait(30)
    releaser = threading.Thread(target=registry.release, args=(ws.id, "operator:0"))
    releaser.start()
    # New operations are refused from the start of the release...
    while True:
        try:
            reads.list_dir(ws, ListParams(workspace=WS))
        except UnknownWorkspace:
            break
    with pytest.raises(UnknownWorkspace):
        registry.get(ws.id)
    # ...while the one in flight still has its root: the release waits for it.
    assert releaser.is_alive() and _same_dir(ws.root_fd, root)
    go.set()
    reader.join(30)
    releaser.join(30)
    assert outcome[0].data == (root / "README.md").read_text()
    assert not _same_dir(ws.root_fd, root)


def test_a_release_that_stops_waiting_leaves_the_fd_to_the_last_user(
    registry: WorkspaceRegistry, ws: Workspace, root: Path
) -> None:
    with ws.use():
        registry.release(ws.id, "operator:0", drain_s=0)  # returns although one is in flight
        assert _same_dir(ws.root_fd, root)
        with pytest.raises(UnknownWorkspace):
            ws.use().__enter__()
    assert not _same_dir(ws.root_fd, root)


# --- list -----------------------------------------------------------------------------------


def test_list_sorted_by_name_bytes_with_kinds(ws: Workspace, root: Path) -> None:
    d = root / "sorting"
    d.mkdir()
    for name in ["b", "B", "a", "_", "é", "Z", "a.txt", "a-b", "10", "9"]:
        (d / name).write_text(name)
    result = reads.list_dir(ws, ListParams(workspace=WS, path="sorting"))
    names = [e.name for e in result.entries]
    assert names == sorted(names, key=os.fsencode)
    assert names == ["10", "9", "B", "Z", "_", "a", "a-b", "a.txt", "b", "é"]
    assert not result.truncated


def test_list_root_reports_symlinks_unfollowed(ws: Workspace, root: Path) -> None:
    result = reads.list_dir(ws, ListParams(workspace=WS))
    by_name = {e.name: e for e in result.entries}
    assert by_name["link-out"].kind == "symlink"
    assert by_name["link-file"].kind == "symlink"
    assert by_name["src"].kind == "dir"
    assert by_name["README.md"] == ListEntry(name="README.md", kind="file", size=20)
    assert by_name[".git"].kind == "dir"


def test_list_truncates(ws: Workspace) -> None:
    full = reads.list_dir(ws, ListParams(workspace=WS))
    short = reads.list_dir(ws, ListParams(workspace=WS, limit=3))
    assert short.entries == full.entries[:3]
    assert short.truncated
    exact = reads.list_dir(ws, ListParams(workspace=WS, limit=len(full.entries)))
    assert not exact.truncated


def test_list_refusals(ws: Workspace) -> None:
    with pytest.raises(NotADirectory):
        reads.list_dir(ws, ListParams(workspace=WS, path="README.md"))
    with pytest.raises(SymlinkRefused):
        reads.list_dir(ws, ListParams(workspace=WS, path="link-out"))
    with pytest.raises(SymlinkRefused):
        reads.list_dir(ws, ListParams(workspace=WS, path="src/link-dir"))
    with pytest.raises(NotFound):
        reads.list_dir(ws, ListParams(workspace=WS, path="nope"))


# --- walk -----------------------------------------------------------------------------------


def walk(ws: Workspace, **kw: Any) -> list[tuple[str, str]]:
    result = reads.walk(ws, WalkParams(workspace=WS, **kw))
    return [(e.path, e.kind) for e in result.paths]


def test_walk_is_preorder_sorted_and_skips_git(ws: Workspace, root: Path) -> None:
    (root / f"{TEMP_PREFIX}abc").write_text("a temp file of a write in flight")
    assert walk(ws) == [
        ("README.md", "file"),
        ("data", "dir"),
        ("data/blob.bin", "file"),
        ("data/latin1.txt", "file"),
        ("docs", "dir"),
        ("docs/a.txt", "file"),
        ("empty", "file"),
        ("keys", "dir"),
        ("keys/id.pem", "file"),
        ("link-file", "symlink"),
        ("link-out", "symlink"),
        ("src", "dir"),
        ("src/link-dir", "symlink"),
        ("src/main.py", "file"),
        ("src/pkg", "dir"),
        ("src/pkg/deep.py", "file"),
        ("src/util.py", "file"),
    ]
    assert walk(ws) == walk(ws)


def test_walk_sizes(ws: Workspace, root: Path) -> None:
    result = reads.walk(ws, WalkParams(workspace=WS, path="docs"))
    assert result.paths == [WalkEntry(path="docs/a.txt", kind="file", size=16)]


def test_walk_include_git(ws: Workspace) -> None:
    found = walk(ws, include_git=True)
    assert (".git", "dir") in found
    assert (".git/HEAD", "file") in found
    assert (".git/refs/heads/main", "file") in found
    assert found.index((".git", "dir")) < found.index(("README.md", "file"))  # "." < "R"


def test_walk_max_depth(ws: Workspace) -> None:
    assert walk(ws, max_depth=0) == []
    top = walk(ws, max_depth=1)
    assert ("src", "dir") in top and all("/" not in p for p, _ in top)
    two = walk(ws, max_depth=2)
    assert ("src/pkg", "dir") in two and ("src/pkg/deep.py", "file") not in two
    assert walk(ws, path="src", max_depth=1) == [
        ("src/link-dir", "symlink"),
        ("src/main.py", "file"),
        ("src/pkg", "dir"),
        ("src/util.py", "file"),
    ]


def test_walk_max_entries(ws: Workspace) -> None:
    full = reads.walk(ws, WalkParams(workspace=WS))
    cut = reads.walk(ws, WalkParams(workspace=WS, max_entries=5))
    assert cut.paths == full.paths[:5] and cut.truncated
    exact = reads.walk(ws, WalkParams(workspace=WS, max_entries=len(full.paths)))
    assert not exact.truncated


def test_walk_never_follows_symlinks(ws: Workspace, root: Path) -> None:
    (root / "src" / "pkg" / "loop").symlink_to("..")
    found = walk(ws)
    assert ("src/pkg/loop", "symlink") in found
    assert not any(p.startswith(("link-out/", "src/link-dir/", "src/pkg/loop/")) for p, _ in found)
    with pytest.raises(SymlinkRefused):
        walk(ws, path="link-out")
    with pytest.raises(NotADirectory):
        walk(ws, path="README.md")


def test_walk_closes_every_fd(ws: Workspace) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        walk(ws)
        walk(ws, max_entries=2)
    assert len(os.listdir("/proc/self/fd")) == before


# --- names that are not UTF-8 ----------------------------------------------------------------


@pytest.fixture
def odd_names(root: Path) -> dict[str, bytes]:
    """Names made through bytes paths: Latin-1, a stray byte, a non-UTF-8 directory."""
    base = os.fsencode(root)
    made = {
        "latin1": b"caf\xe9.txt",
        "stray": b"bad\xff\xfename",
        "dir": b"d\xff",
        "inner": b"d\xff/hello.txt",
    }
    for key in ("latin1", "stray"):
        with open(base + b"/" + made[key], "wb") as f:
            f.write(b"hello odd\n")
    os.mkdir(base + b"/" + made["dir"])
    with open(base + b"/" + made["inner"], "wb") as f:
        f.write(b"hello inner\n")
    return made


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_list_shows_names_that_are_not_utf8_escaped(
    ws: Workspace, odd_names: dict[str, bytes]
) -> None:
    result = reads.list_dir(ws, ListParams(workspace=WS))
    odd = {e.name: e for e in result.entries if e.name_b64 is not None}
    assert odd == {
        "caf\\xe9.txt": ListEntry(
            name="caf\\xe9.txt", kind="file", size=10, name_b64=b64(odd_names["latin1"])
        ),
        "bad\\xff\\xfename": ListEntry(
            name="bad\\xff\\xfename", kind="file", size=10, name_b64=b64(odd_names["stray"])
        ),
        "d\\xff": ListEntry(
            name="d\\xff", kind="dir", size=odd["d\\xff"].size, name_b64=b64(b"d\xff")
        ),
    }
    # UTF-8 names carry no extra field; the whole result is valid JSON.
    readme = next(e for e in result.entries if e.name == "README.md")
    assert readme.name_b64 is None
    assert b"name_b64" not in msgspec.json.encode(readme)
    msgspec.json.encode(result)


def test_walk_and_search_show_paths_that_are_not_utf8_escaped(
    ws: Workspace, odd_names: dict[str, bytes]
) -> None:
    found = reads.walk(ws, WalkParams(workspace=WS))
    odd = [(e.path, e.kind, e.path_b64) for e in found.paths if e.path_b64 is not None]
    assert odd == [
        ("bad\\xff\\xfename", "file", b64(odd_names["stray"])),
        ("caf\\xe9.txt", "file", b64(odd_names["latin1"])),
        ("d\\xff", "dir", b64(odd_names["dir"])),
        ("d\\xff/hello.txt", "file", b64(odd_names["inner"])),
    ]
    msgspec.json.encode(found)
    result = reads.search(ws, SearchParams(workspace=WS, pattern="hello (odd|inner)"))
    assert [(m.path, m.path_b64, m.text) for m in result.matches] == [
        ("bad\\xff\\xfename", b64(odd_names["stray"]), "hello odd"),
        ("caf\\xe9.txt", b64(odd_names["latin1"]), "hello odd"),
        ("d\\xff/hello.txt", b64(odd_names["inner"]), "hello inner"),
    ]
    msgspec.json.encode(result)


def test_read_deny_still_applies_to_names_that_are_not_utf8(
    ws: Workspace, root: Path, odd_names: dict[str, bytes]
) -> None:
    with open(os.fsencode(root) + b"/keys/k\xff.pem", "wb") as f:
        f.write(b"hello secret\n")
    result = reads.search(ws, SearchParams(workspace=WS, pattern="hello secret"))
    assert result.matches == []


# --- search ---------------------------------------------------------------------------------


def test_search_regex_lines_and_columns(ws: Workspace) -> None:
    assert search(ws, r"^def \w+") == [
        ("src/main.py", 3, 1, "def main() -> None:"),
        ("src/main.py", 7, 1, "def helper():"),
        ("src/pkg/deep.py", 1, 1, "def deep():"),
    ]
    assert search(ws, "gamma") == [("docs/a.txt", 3, 1, "gamma")]  # last line, no newline
    assert search(ws, "print") == [("src/main.py", 4, 5, "    print('hello')")]


def test_search_one_match_per_line_and_counts(ws: Workspace, root: Path) -> None:
    (root / "twice.txt").write_text("x hello hello\nhello\n")
    assert search(ws, "hello", glob="twice.txt") == [
        ("twice.txt", 1, 3, "x hello hello"),
        ("twice.txt", 2, 1, "hello"),
    ]
    result = reads.search(ws, SearchParams(workspace=WS, pattern="hello", glob="twice.txt"))
    assert (result.files_scanned, result.bytes_scanned, result.truncated) == (1, 20, False)


def test_search_fixed_and_ignore_case(ws: Workspace) -> None:
    assert search(ws, "main() -> None", fixed=True) == [
        ("src/main.py", 3, 5, "def main() -> None:")
    ]
    assert search(ws, "main() -> None") == []  # as a regex, `()` is a group
    assert [m[:2] for m in search(ws, "HELLO =")] == [("src/util.py", 2)]
    insensitive = search(ws, "hello", ignore_case=True, glob="util.py")
    assert insensitive == [("src/util.py", 2, 1, "HELLO = 'Hello'")]


def test_search_glob(ws: Workspace) -> None:
    every_py = {m[0] for m in search(ws, "def", glob="*.py")}
    assert every_py == {"src/main.py", "src/pkg/deep.py"}
    top_py = {m[0] for m in search(ws, "def", glob="src/*.py")}
    assert top_py == {"src/main.py"}
    assert {m[0] for m in search(ws, "hello", glob="docs/")} == set()
    assert {m[0] for m in search(ws, "hello", path="src")} == {"src/main.py", "src/pkg/deep.py"}


def test_search_bad_glob_names_the_glob_field(ws: Workspace) -> None:
    with pytest.raises(InvalidParams) as info:
        reads.search(ws, SearchParams(workspace=WS, pattern="x", glob="!x"))
    assert info.value.data["path"] == "$.glob"


def test_search_bad_regex(ws: Workspace) -> None:
    with pytest.raises(InvalidParams) as info:
        reads.search(ws, SearchParams(workspace=WS, pattern="(unclosed"))
    assert info.value.data["path"] == "$.pattern"
    assert search(ws, "(unclosed", fixed=True) == []


def test_search_max_matches(ws: Workspace) -> None:
    full = reads.search(ws, SearchParams(workspace=WS, pattern="e"))
    assert not full.truncated and len(full.matches) > 3
    cut = reads.search(ws, SearchParams(workspace=WS, pattern="e", max_matches=3))
    assert cut.truncated and cut.matches == full.matches[:3]


def test_search_max_line_bytes(ws: Workspace, root: Path) -> None:
    (root / "long.txt").write_text("needle " + "x" * 100 + "\n" + "é" * 20 + "needle\n")
    found = search(ws, "needle", glob="long.txt", max_line_bytes=16)
    assert found[0] == ("long.txt", 1, 1, "needle xxxxxxxxx")
    # A cut inside a multi-byte character is replaced, never an invalid string.
    assert found[1][:3] == ("long.txt", 2, 41)
    assert found[1][3] == "é" * 8


def test_search_skips_binary_denied_symlinked_and_git(ws: Workspace, root: Path) -> None:
    found = {m[0] for m in search(ws, "hello")}
    assert "data/blob.bin" not in found  # binary: a NUL in the first 8 KiB
    assert "keys/id.pem" not in found  # read_deny
    assert "link-file" not in found  # a symlink to README.md
    assert not any(p.startswith("link-out") for p in found)  # a symlink to outside
    assert "data/latin1.txt" in found  # not UTF-8, but text
    assert "README.md" in found
    (root / ".git" / "notes").write_text("hello\n")
    assert not any(p.startswith(".git") for p in {m[0] for m in search(ws, "hello")})


def test_search_late_nul_is_still_text(ws: Workspace, root: Path) -> None:
    (root / "late.txt").write_bytes(b"a" * 9000 + b"\x00\nhello\n")
    assert search(ws, "hello", glob="late.txt") == [("late.txt", 2, 1, "hello")]


def test_search_skips_fifos_without_blocking(ws: Workspace, root: Path) -> None:
    os.mkfifo(root / "src" / "fifo")
    assert [m[0] for m in search(ws, "VALUE")] == ["src/util.py"]


def test_search_counts_scanned_files(ws: Workspace) -> None:
    result = reads.search(ws, SearchParams(workspace=WS, pattern="zzz-nothing"))
    texts = ["README.md", "src/main.py", "src/util.py", "src/pkg/deep.py", "docs/a.txt"]
    texts += ["data/latin1.txt", "empty"]
    assert result.files_scanned == len(texts)
    assert result.bytes_scanned == sum(
        len(v if isinstance(v, bytes) else v.encode()) for k, v in FILES.items() if k in texts
    )
    assert result.matches == [] and not result.truncated


def test_search_crlf_and_anchors(ws: Workspace, root: Path) -> None:
    (root / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    assert search(ws, "^two", glob="crlf.txt") == [("crlf.txt", 2, 1, "two\r")]
    assert search(ws, "one$", glob="crlf.txt") == []  # `$` is before "\n", the "\r" is in the way


def test_search_empty_matches_terminate(ws: Workspace) -> None:
    found = search(ws, "^", glob="docs/a.txt")
    assert found == [
        ("docs/a.txt", 1, 1, "alpha"),
        ("docs/a.txt", 2, 1, "beta"),
        ("docs/a.txt", 3, 1, "gamma"),
    ]


# --- the search prefilter keeps results identical --------------------------------------------


def _reference_collect(
    regex: re.Pattern[bytes], data: bytes, rel: str, max_line_bytes: int, limit: int
) -> list[SearchMatch]:
    """The plain algorithm: regex over the whole file, one match per line."""
    out: list[SearchMatch] = []
    line_no, counted_to, pos = 1, 0, 0
    while pos <= len(data):
        m = regex.search(data, pos)
        if m is None:
            break
        start = data.rfind(b"\n", 0, m.start()) + 1
        end = data.find(b"\n", m.start())
        end = len(data) if end < 0 else end
        line_no += data.count(b"\n", counted_to, start)
        counted_to = start
        text = data[start:end][:max_line_bytes].decode("utf-8", "replace")
        out.append(SearchMatch(path=rel, line=line_no, column=m.start() - start + 1, text=text))
        if len(out) >= limit:
            break
        pos = end + 1
    return out


_ATOMS = [
    "a",
    "b",
    "ab",
    "abc",
    "A",
    "_x",
    "x(",
    "\\(",
    "1",
    " ",
    "\\n",
    "\\.",
    ".",
    "\\w",
    "\\d",
    "\\s",
    "\\S",
    "\\W",
    "\\D",
    "[a-c]",
    "[^a]",
    "[^\\n]",
    "[\\s\\S]",
    "[A-Z]",
    "(ab)",
    "(?:a|b)",
    "(a|\\n)",
    "^",
    "$",
    "\\b",
    "\\B",
    "\\A",
    "\\Z",
    "(?=a)",
    "(?!b)",
    "(?<=a)",
    "(?s:.)",
    "(?i:ab)",
    "(?>ab)",
    "(a)\\1",
    "é",
]
_QUANTS = ["", "", "", "*", "+", "?", "{1,3}", "*?", "+?", "{2}", "*+"]


def _random_pattern(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 5)):
        atom = rng.choice(_ATOMS)
        quant = rng.choice(_QUANTS)
        if quant and atom in ("^", "$", "\\b", "\\B", "\\A", "\\Z"):
            quant = ""
        parts.append(atom + quant)
    pattern = "".join(parts)
    if rng.random() < 0.15:
        pattern = pattern + "|" + rng.choice(_ATOMS)
    if rng.random() < 0.1:
        pattern = rng.choice(["(?i)", "(?s)", "(?m)", "(?x)"]) + pattern
    return pattern


def _random_text(rng: random.Random) -> bytes:
    alphabet = ["a", "b", "c", "A", "B", "x", "(", " ", "\n", "\n", "\r\n", "1", "_", "é", "."]
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120))).encode()


def test_prefilter_never_changes_search_results() -> None:
    rng = random.Random(1234)
    checked = 0
    shortcut = 0
    for _ in range(4000):
        pattern = _random_pattern(rng)
        ignore_case = rng.random() < 0.3
        fixed = rng.random() < 0.1
        params = SearchParams(workspace=WS, pattern=pattern, fixed=fixed, ignore_case=ignore_case)
        try:
            regex = reads._compile_search(params)
        except InvalidParams:
            continue
        prefilter = reads._Prefilter.of(regex)
        shortcut += bool(prefilter.literal)
        for _ in range(5):
            data = _random_text(rng)
            limit = rng.choice([1, 3, 1000])
            got: list[SearchMatch] = []
            reads._collect(regex, prefilter, data, "f", 16, got, limit)
            assert got == _reference_collect(regex, data, "f", 16, limit), (pattern, data)
            checked += 1
    assert checked > 10000 and shortcut > 1000  # the shortcut was exercised, often


@pytest.mark.parametrize(
    ("pattern", "flags", "literal", "line_bound"),
    [
        (rb"def \w+_handler\(", 0, b"_handler(", True),
        (rb"[A-Z][a-z]+Error\(\w+", 0, b"Error(", True),
        (rb"abc", re.IGNORECASE, b"abc", True),
        (rb"ABC", re.IGNORECASE, b"abc", True),
        (rb"a\nb", 0, b"a\nb", False),  # the literal holds a newline
        (rb"foo\s+bar", 0, b"foo", False),  # \s matches a newline
        (rb"foo[^x]bar", 0, b"foo", False),
        (rb"foo(?=bar)", 0, b"foo", False),  # a lookahead may look past the line
        (rb"foo\Z", 0, b"foo", False),
        (rb"foo.bar", 0, b"foo", True),
        (rb"foo.bar", re.DOTALL, b"foo", False),  # files are still filtered, lines not
        (rb"(?s)foo.bar", 0, b"foo", False),
        (rb"(?i:foo)bar", 0, b"", False),  # scoped flags: no shortcut at all
        (rb"foo|bar", 0, b"", False),  # no single literal is required
        (rb"(?:foo)+x*", 0, b"foo", True),
        (rb"(?:foo)*x", 0, b"x", True),
        (rb"\d+", 0, b"", False),
    ],
)
def test_prefilter_analysis(pattern: bytes, flags: int, literal: bytes, line_bound: bool) -> None:
    prefilter = reads._Prefilter.of(re.compile(pattern, re.MULTILINE | flags))
    assert (prefilter.literal, prefilter.line_bound) == (literal, line_bound)
