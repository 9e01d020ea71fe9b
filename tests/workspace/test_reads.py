"""substrate.workspace.reads in-process: stat, read (with digests), list and walk on a real temp workspace.

Search is tested in test_search.py."""

from __future__ import annotations

import base64
import hashlib
import os
import stat
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import pytest

from substrate.errors import (
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
    SearchParams,
    StatParams,
    StatResult,
    WalkEntry,
    WalkParams,
)
from substrate.workspace import digests as digests_module
from substrate.workspace import reads
from substrate.workspace import search as search_module
from substrate.workspace.registry import TEMP_PREFIX, Workspace, WorkspaceRegistry

WS = "ws_test"

# FILES and the registry/root/ws fixtures: tests/harness/read_tree.py


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stat_path(ws: Workspace, p: StatParams) -> StatResult:
    return reads.stat_path(ws, p, reads.Digests())


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
    data = os.urandom(3 * digests_module.CHUNK + 17)
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
    data = os.urandom(2 * digests_module.CHUNK + 1000)
    (root / "big.bin").write_bytes(data)
    start = digests_module.CHUNK - 10
    result = read(ws, "big.bin", offset=start, length=digests_module.CHUNK + 50)
    assert base64.b64decode(result.data) == data[start : start + digests_module.CHUNK + 50]
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

    monkeypatch.setattr(digests_module, "hash_fd", refuse)


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
    data = os.urandom(3 * digests_module.CHUNK + 5)
    (root / "mid.bin").write_bytes(data)
    digests = reads.Digests(racy_ns=0)
    p = StatParams(workspace=WS, path="mid.bin")
    assert reads.stat_path(ws, p, digests, digests_module.CHUNK).sha256_deferred
    asked = reads.stat_path(ws, p, digests, None)
    assert (asked.sha256, asked.sha256_deferred) == (sha(data), False)
    _no_hashing(monkeypatch)
    # Known now: given within the bound, by stat and read alike, without another pass.
    assert reads.stat_path(ws, p, digests, digests_module.CHUNK).sha256 == sha(data)
    r = ReadParams(workspace=WS, path="mid.bin", length=4)
    assert reads.read_file(ws, r, digests, digests_module.CHUNK).sha256 == sha(data)
    # Another version (here: another size) is another digest, not the kept one.
    with open(root / "mid.bin", "ab") as f:
        f.write(b"more")
    assert reads.stat_path(ws, p, digests, digests_module.CHUNK).sha256_deferred


def test_a_digest_of_a_file_changed_just_now_is_not_kept(
    ws: Workspace, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within the racy window a same-size change could keep the times: recompute instead."""
    (root / "fresh.bin").write_bytes(os.urandom(2 * digests_module.CHUNK))
    digests = reads.Digests(racy_ns=3600 * 10**9)
    p = StatParams(workspace=WS, path="fresh.bin")
    assert reads.stat_path(ws, p, digests, None).sha256 is not None
    assert reads.stat_path(ws, p, digests, digests_module.CHUNK).sha256_deferred


def test_concurrent_askers_share_one_hash(
    ws: Workspace, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(2 * digests_module.CHUNK)
    (root / "shared.bin").write_bytes(data)
    real_hash = digests_module.hash_fd
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

    monkeypatch.setattr(digests_module, "hash_fd", slow_hash)
    monkeypatch.setattr(digests_module, "Future", WatchedFuture)
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
    result = search_module.search(ws, SearchParams(workspace=WS, pattern="hello (odd|inner)"))
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
    result = search_module.search(ws, SearchParams(workspace=WS, pattern="hello secret"))
    assert result.matches == []
