"""substrate.fs.paths: relative-path validation and symlink-refusing opens through dir fds.

Every open is exercised twice: with `openat2` (where the kernel has it) and with the
component-by-component `O_NOFOLLOW` walk that is the fallback.
"""

from __future__ import annotations

import base64
import errno
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.errors import (
    Internal,
    NotADirectory,
    NotAFile,
    NotFound,
    PathDenied,
    PathEscape,
    PathInvalid,
    Refusal,
    SymlinkRefused,
)
from substrate.fs import paths

# --- wire_name (pure) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"plain.txt", "plain.txt"),
        ("caf\u00e9 \u2603.txt".encode(), "caf\u00e9 \u2603.txt"),  # UTF-8: as is
        (b"caf\xe9.txt", "caf\\xe9.txt"),  # Latin-1
        (b"\xff\xfe", "\\xff\\xfe"),
        (b"d\xff/caf\xc3\xa9", "d\\xff/caf\u00e9"),  # only the bad bytes are escaped
        (b"\xed\xa0\x80", "\\xed\\xa0\\x80"),  # an encoded surrogate is not UTF-8
    ],
)
def test_wire_name(raw: bytes, text: str) -> None:
    """Names from `os` (surrogateescape) become JSON-safe text, with the bytes when lossy."""
    shown, b64 = paths.wire_name(os.fsdecode(raw))
    assert shown == text
    shown.encode("utf-8")  # always encodable
    if raw.decode("utf-8", "replace").encode() == raw:
        assert b64 is None
    else:
        assert b64 is not None and base64.b64decode(b64) == raw


# --- split_relpath (pure) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "parts"),
    [
        ("a", ("a",)),
        ("a/b/c.txt", ("a", "b", "c.txt")),
        (".hidden", (".hidden",)),
        ("a/..b/c..", ("a", "..b", "c..")),
        ("dir with space/é.txt", ("dir with space", "é.txt")),
        ("x" * 255, ("x" * 255,)),
    ],
)
def test_split_relpath_accepts(path: str, parts: tuple[str, ...]) -> None:
    assert paths.split_relpath(path) == parts


def test_dot_is_the_root_only_when_allowed() -> None:
    assert paths.split_relpath(".", allow_root=True) == ()
    with pytest.raises(PathInvalid):
        paths.split_relpath(".")


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("", id="empty"),
        pytest.param("/etc/passwd", id="absolute"),
        pytest.param("/", id="slash"),
        pytest.param("a\x00b", id="nul"),
        pytest.param("a\\b", id="backslash"),
        pytest.param("..", id="dotdot"),
        pytest.param("../x", id="dotdot-first"),
        pytest.param("a/../../x", id="dotdot-middle"),
        pytest.param("a/..", id="dotdot-last"),
        pytest.param("./a", id="dot-first"),
        pytest.param("a/./b", id="dot-middle"),
        pytest.param("a//b", id="empty-component"),
        pytest.param("a/", id="trailing-slash"),
        pytest.param("a/\udcff", id="not-utf8"),
        pytest.param("/".join(["d" * 200] * 21), id="over-4096-bytes"),
        pytest.param("x" * 256, id="name-over-255-bytes"),
        pytest.param("é" * 128, id="name-over-255-bytes-multibyte"),
    ],
)
def test_split_relpath_refuses(path: str) -> None:
    with pytest.raises(PathInvalid) as info:
        paths.split_relpath(path, allow_root=True)
    assert info.value.name == "path_invalid"


def test_path_of_exactly_4096_bytes_is_accepted() -> None:
    path = "/".join(["d" * 200] * 20) + "/e" * 28  # 20 * 200 + 19 + 2 * 28 = 4075
    path += "f" * 21
    assert len(path.encode()) == 4096
    assert len(paths.split_relpath(path)) == 48
    with pytest.raises(PathInvalid):
        paths.split_relpath(path + "g")


def test_kind_of() -> None:
    assert paths.kind_of(stat.S_IFREG | 0o644) == "file"
    assert paths.kind_of(stat.S_IFDIR | 0o755) == "dir"
    assert paths.kind_of(stat.S_IFLNK | 0o777) == "symlink"
    assert paths.kind_of(stat.S_IFIFO | 0o644) == "other"
    assert paths.kind_of(stat.S_IFSOCK | 0o644) == "other"


@pytest.mark.parametrize(
    ("err", "refusal"),
    [
        (errno.ELOOP, SymlinkRefused),
        (errno.ENOENT, NotFound),
        (errno.ENOTDIR, NotADirectory),
        (errno.EISDIR, NotAFile),
        (errno.ENXIO, NotAFile),
        (errno.ENODEV, NotAFile),
        (errno.EXDEV, PathEscape),
        (errno.EACCES, PathDenied),
        (errno.EPERM, PathDenied),
        (errno.ENAMETOOLONG, PathInvalid),
        (errno.EIO, Internal),
    ],
)
def test_refusal_for(err: int, refusal: type[Refusal]) -> None:
    found = paths.refusal_for(OSError(err, os.strerror(err)), "ws:a/b")
    assert type(found) is refusal
    assert "ws:a/b" in found.message


# --- opens beneath a root fd ---------------------------------------------------------------


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with openat2, then with the fallback walk; restore afterwards."""
    if request.param == "openat2":
        paths.use_openat2(True)
        if not paths._has_openat2():
            pytest.skip("this kernel has no openat2; the walk variant covers the logic")
    else:
        paths.use_openat2(False)
        assert not paths._has_openat2()
    try:
        yield request.param
    finally:
        paths.use_openat2(True)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, Path, int]]:
    """(workspace, outside, root fd): a/b/c dirs, a file, and symlinks in and out."""
    ws = tmp_path / "ws"
    outside = tmp_path / "outside"
    (ws / "a" / "b" / "c").mkdir(parents=True)
    (ws / "a" / "b" / "c" / "f.txt").write_text("inside\n")
    (ws / "file").write_text("x")
    (outside / "b" / "c").mkdir(parents=True)
    (outside / "b" / "c" / "f.txt").write_text("outside\n")
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield ws, outside, fd
    finally:
        os.close(fd)


def _same_dir(fd: int, path: Path) -> bool:
    a, b = os.fstat(fd), os.stat(path)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def test_open_dir_opens_beneath_the_root(resolver: str, tree: tuple[Path, Path, int]) -> None:
    ws, _, root = tree
    for parts in [(), ("a",), ("a", "b"), ("a", "b", "c")]:
        fd = paths.open_dir(root, parts)
        try:
            assert _same_dir(fd, ws.joinpath(*parts))
        finally:
            os.close(fd)


def test_open_dir_opens_a_directory_4096_bytes_deep(resolver: str, tmp_path: Path) -> None:
    # 17 names of 240 bytes: 4,096 bytes, which the guarded path takes and one
    # openat2 does not (PATH_MAX counts the NUL): walked a component at a time.
    parts = ("d" * 240,) * 17
    assert len("/".join(parts).encode()) == paths.MAX_PATH_BYTES
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        here = os.dup(root)
        for part in parts:
            os.mkdir(part, dir_fd=here)
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            here = nxt
        fd = paths.open_dir(root, parts)
        try:
            assert os.path.samestat(os.fstat(fd), os.fstat(here))
        finally:
            os.close(fd)
            os.close(here)
    finally:
        os.close(root)


def test_use_openat2_can_be_switched_off_and_on_again() -> None:
    expected = paths._has_openat2()
    try:
        paths.use_openat2(False)
        assert not paths._has_openat2()
        paths.use_openat2(True)
        assert paths._has_openat2() is expected
    finally:
        paths.use_openat2(True)


def test_opened_dir_closes_its_fd(resolver: str, tree: tuple[Path, Path, int]) -> None:
    _, _, root = tree
    with paths.opened_dir(root, ("a",)) as fd:
        held = fd
        os.fstat(held)
    with pytest.raises(OSError) as info:
        os.fstat(held)
    assert info.value.errno == errno.EBADF


@pytest.mark.parametrize("target", ["inside", "outside"])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_symlink_at_any_component_is_refused(
    resolver: str, tree: tuple[Path, Path, int], target: str, depth: int
) -> None:
    ws, outside, root = tree
    chain = ["a", "b", "c"]
    # Replace component `depth` of a/b/c with a symlink to an equivalent directory.
    real = ws.joinpath(*chain[: depth + 1])
    moved = ws / f"moved-{depth}"
    real.rename(moved)
    dest = moved if target == "inside" else outside.joinpath(*chain[1 : depth + 1]) or outside
    real.symlink_to(dest)
    with pytest.raises(SymlinkRefused):
        paths.open_dir(root, chain, "ws:a/b/c")
    with pytest.raises(SymlinkRefused):
        paths.open_dir(root, chain[: depth + 1])


def test_symlink_to_the_root_itself_is_refused(resolver: str, tree: tuple[Path, Path, int]) -> None:
    ws, _, root = tree
    (ws / "self").symlink_to(".")
    with pytest.raises(SymlinkRefused):
        paths.open_dir(root, ("self",))
    with pytest.raises(SymlinkRefused):
        paths.open_dir(root, ("self", "a"))


def test_open_dir_missing_and_not_a_directory(resolver: str, tree: tuple[Path, Path, int]) -> None:
    _, _, root = tree
    with pytest.raises(NotFound):
        paths.open_dir(root, ("nope",))
    with pytest.raises(NotFound):
        paths.open_dir(root, ("a", "nope", "c"))
    with pytest.raises(NotADirectory):
        paths.open_dir(root, ("file",))
    with pytest.raises(NotADirectory):
        paths.open_dir(root, ("file", "x"))


def test_open_dir_leaks_no_fd_on_refusal(resolver: str, tree: tuple[Path, Path, int]) -> None:
    ws, _, root = tree
    (ws / "a" / "b" / "link").symlink_to("c")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with pytest.raises(SymlinkRefused):
            paths.open_dir(root, ("a", "b", "link", "x"))
        with pytest.raises(NotFound):
            paths.open_dir(root, ("a", "b", "missing"))
    assert len(os.listdir("/proc/self/fd")) == before


def test_openat2_refuses_dotdot_as_escape(tree: tuple[Path, Path, int]) -> None:
    """Defense in depth: RESOLVE_BENEATH itself stops `..` (split_relpath refuses it first)."""
    _, _, root = tree
    if not paths._has_openat2():
        pytest.skip("this kernel has no openat2")
    with pytest.raises(OSError) as info:
        paths._openat2(root, "../outside", os.O_RDONLY | os.O_DIRECTORY)
    assert isinstance(paths.refusal_for(info.value, "x"), PathEscape)


def test_lstat_at(tree: tuple[Path, Path, int]) -> None:
    ws, _, root = tree
    (ws / "ln").symlink_to("file")
    assert paths.lstat_at(root, "missing") is None
    st = paths.lstat_at(root, "ln")
    assert st is not None and stat.S_ISLNK(st.st_mode)
    st = paths.lstat_at(root, "file")
    assert st is not None and stat.S_ISREG(st.st_mode)


def test_open_regular_reads_a_file(tree: tuple[Path, Path, int]) -> None:
    _, _, root = tree
    fd = paths.open_regular(root, "file", "ws:file")
    try:
        assert os.read(fd, 10) == b"x"
        assert os.get_blocking(fd)
    finally:
        os.close(fd)


def test_open_regular_refuses_symlink_dir_missing(tree: tuple[Path, Path, int]) -> None:
    ws, outside, root = tree
    (ws / "ln-in").symlink_to("file")
    (ws / "ln-out").symlink_to(outside / "b" / "c" / "f.txt")
    with pytest.raises(SymlinkRefused):
        paths.open_regular(root, "ln-in", "ws:ln-in")
    with pytest.raises(SymlinkRefused):
        paths.open_regular(root, "ln-out", "ws:ln-out")
    with pytest.raises(NotAFile):
        paths.open_regular(root, "a", "ws:a")
    with pytest.raises(NotFound):
        paths.open_regular(root, "missing", "ws:missing")


def test_open_regular_fifo_is_not_a_file_and_never_blocks(tree: tuple[Path, Path, int]) -> None:
    ws, _, root = tree
    os.mkfifo(ws / "fifo")
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            os.close(paths.open_regular(root, "fifo", "ws:fifo"))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    # A thread so that a regression (a blocking open) fails the test instead of hanging it.
    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "opening a FIFO blocked"
    assert len(outcome) == 1 and isinstance(outcome[0], NotAFile)


def test_open_regular_refuses_a_socket_and_a_device(tree: tuple[Path, Path, int]) -> None:
    ws, _, root = tree
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(ws / "sock"))
        with pytest.raises(NotAFile):
            paths.open_regular(root, "sock", "ws:sock")
    dev = os.open("/dev", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(NotAFile):
            paths.open_regular(dev, "null", "/dev/null")
    finally:
        os.close(dev)
