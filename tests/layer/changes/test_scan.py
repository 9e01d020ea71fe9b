"""substrate.layer.changes.scan on real directories: hand-made upper layers and a real overlay mount."""

from __future__ import annotations

import hashlib
import importlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.layer.changes import ChangeSet, scan

# The module (the package exports the function under the same name).
scan_module = importlib.import_module("substrate.layer.changes.scan")

DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def scan_dirs(upper: Path, lower: Path, **bounds: int) -> ChangeSet:
    ufd, lfd = os.open(upper, DIR), os.open(lower, DIR)
    try:
        return scan(ufd, lfd, **bounds)
    finally:
        os.close(ufd)
        os.close(lfd)


def summary(cs: ChangeSet) -> tuple[list[tuple[object, ...]], list[tuple[str, str, str]]]:
    return (
        [(c.path, c.op, c.kind, c.base_sha256, c.new_sha256, c.size, c.mode) for c in cs.changes],
        [(b.path, b.kind, b.reason) for b in cs.blocked],
    )


def whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


@pytest.fixture
def layers(tmp_path: Path) -> tuple[Path, Path]:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    (lower / "d" / "sub").mkdir(parents=True)
    (lower / "a.txt").write_bytes(b"a\n")
    (lower / "m.sh").write_bytes(b"echo\n")
    (lower / "d" / "x").write_bytes(b"x\n")
    (lower / "d" / "sub" / "y").write_bytes(b"y\n")
    (lower / "keep").write_bytes(b"k\n")
    upper.mkdir()
    return lower, upper


def test_hand_made_upper_layer(layers: tuple[Path, Path]) -> None:
    lower, upper = layers
    (upper / "a.txt").write_bytes(b"A\n")  # replaced
    (upper / "m.sh").write_bytes(b"echo\n")  # copied up, only the mode moved
    os.chmod(upper / "m.sh", 0o755)
    (upper / "keep").write_bytes(b"k\n")  # copied up, nothing moved
    os.chmod(upper / "keep", 0o644)
    os.chmod(lower / "keep", 0o644)
    whiteout(upper / "d")  # the whole lower directory deleted
    (upper / "new").mkdir(mode=0o750)
    os.chmod(upper / "new", 0o750)
    (upper / "new" / "f").write_bytes(b"f\n")
    os.chmod(upper / "new" / "f", 0o600)
    whiteout(upper / "never-there")  # a whiteout for nothing is nothing
    os.symlink("/etc/passwd", upper / "link")
    os.mkfifo(upper / "fifo")
    (upper / "h1").write_bytes(b"h\n")
    os.link(upper / "h1", upper / "h2")
    os.mknod(upper / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    changes, blocked = summary(scan_dirs(upper, lower))
    assert changes == [
        ("d/sub/y", "delete", "file", sha(b"y\n"), None, 0, None),
        ("d/sub", "delete", "dir", None, None, 0, None),
        ("d/x", "delete", "file", sha(b"x\n"), None, 0, None),
        ("d", "delete", "dir", None, None, 0, None),
        ("new", "mkdir", "dir", None, None, 0, 0o750),
        ("a.txt", "replace", "file", sha(b"a\n"), sha(b"A\n"), 2, 0o644),
        # Hard links: each name a file of its own; a symlink: its target's digest.
        ("h1", "create", "file", None, sha(b"h\n"), 2, 0o644),
        ("h2", "create", "file", None, sha(b"h\n"), 2, 0o644),
        ("link", "create", "symlink", None, sha(b"/etc/passwd"), 11, None),
        ("m.sh", "chmod", "file", sha(b"echo\n"), sha(b"echo\n"), 5, 0o755),
        ("new/f", "create", "file", None, sha(b"f\n"), 2, 0o600),
    ]
    assert blocked == [
        ("dev", "device", "device"),
        ("fifo", "fifo", "fifo"),
    ]


def test_opaque_dir_deletes_what_the_upper_lacks(layers: tuple[Path, Path]) -> None:
    lower, upper = layers
    (upper / "d").mkdir()
    os.setxattr(upper / "d", "trusted.overlay.opaque", b"y")
    (upper / "d" / "x").write_bytes(b"x\n")  # recreated with the same bytes: nothing
    (upper / "d" / "z").write_bytes(b"z\n")
    changes, blocked = summary(scan_dirs(upper, lower))
    assert changes == [
        ("d/sub/y", "delete", "file", sha(b"y\n"), None, 0, None),
        ("d/sub", "delete", "dir", None, None, 0, None),
        ("d/z", "create", "file", None, sha(b"z\n"), 2, 0o644),
    ]
    assert blocked == []


def test_xattr_whiteout_and_kind_swaps(layers: tuple[Path, Path]) -> None:
    lower, upper = layers
    (upper / "keep").write_bytes(b"")
    os.setxattr(upper / "keep", "trusted.overlay.whiteout", b"")
    (upper / "a.txt").mkdir()  # a file replaced by a directory
    (upper / "d").write_bytes(b"now a file\n")  # a directory replaced by a file
    changes, _ = summary(scan_dirs(upper, lower))
    assert [(c[0], c[1], c[2]) for c in changes] == [
        ("d/sub/y", "delete", "file"),
        ("d/sub", "delete", "dir"),
        ("d/x", "delete", "file"),
        ("a.txt", "delete", "file"),
        ("d", "delete", "dir"),
        ("keep", "delete", "file"),
        ("a.txt", "mkdir", "dir"),
        ("d", "create", "file"),
    ]


def test_lower_symlinks_are_never_followed_only_deleted(layers: tuple[Path, Path]) -> None:
    lower, upper = layers
    os.symlink("d", lower / "ln")
    whiteout(upper / "ln")
    (upper / "ln2").mkdir()
    (upper / "ln2" / "f").write_bytes(b"f\n")
    os.symlink("/", lower / "ln2")
    changes, blocked = summary(scan_dirs(upper, lower))
    assert blocked == []
    assert changes == [
        ("ln", "delete", "symlink", sha(b"d"), None, 0, None),
        ("ln2", "delete", "symlink", sha(b"/"), None, 0, None),
        ("ln2", "mkdir", "dir", None, None, 0, 0o755),
        ("ln2/f", "create", "file", None, sha(b"f\n"), 2, 0o644),
    ]


def test_non_utf8_names_are_blocked_and_escaped(layers: tuple[Path, Path]) -> None:
    lower, upper = layers
    os.mkdir(os.path.join(os.fsencode(upper), b"bad\xff"))
    with open(os.path.join(os.fsencode(upper), b"bad\xff", b"f"), "wb") as f:
        f.write(b"x")
    changes, blocked = summary(scan_dirs(upper, lower))
    assert changes == []
    assert blocked == [("bad\\xff", "dir", "name_not_utf8")]


def test_past_a_bound_the_part_past_it_is_blocked_by_name_and_the_rest_kept(
    layers: tuple[Path, Path],
) -> None:
    lower, upper = layers
    deep = upper / "1" / "2" / "3"
    deep.mkdir(parents=True)
    (deep / "f").write_bytes(b"0123456789")
    (upper / "top").write_bytes(b"top")
    changes, blocked = summary(scan_dirs(upper, lower, max_depth=2))
    assert [c[:2] for c in changes] == [("1", "mkdir"), ("1/2", "mkdir"), ("top", "create")]
    assert blocked == [("1/2/3", "dir", "too_deep")]  # the shallowest path past it
    # A path longer than the guarded path takes: blocked where it passes.
    changes, blocked = summary(scan_dirs(upper, lower, max_path_bytes=4))
    assert [c[:2] for c in changes] == [("1", "mkdir"), ("1/2", "mkdir"), ("top", "create")]
    assert blocked == [("1/2/3", "dir", "too_long")]
    # Bytes to hash: the file past the budget is blocked, what fits is not.
    changes, blocked = summary(scan_dirs(upper, lower, max_bytes=5))
    assert [c[:2] for c in changes] == [
        ("1", "mkdir"),
        ("1/2", "mkdir"),
        ("1/2/3", "mkdir"),
        ("top", "create"),
    ]
    assert blocked == [("1/2/3/f", "file", "too_large")]
    assert len(scan_dirs(upper, lower, max_entries=5, max_depth=4, max_bytes=13).changes) == 5


def test_a_directory_past_the_entry_bound_is_blocked_whole_and_never_listed(
    layers: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    lower, upper = layers
    (upper / "many").mkdir()
    for i in range(50):
        (upper / "many" / f"f{i:02}").write_bytes(b"x")
    (upper / "top.txt").write_bytes(b"top\n")
    listed: list[int] = []
    real = os.scandir

    def counting(fd: int) -> object:
        it = real(fd)
        listed.append(0)

        class Counted:
            def __enter__(self) -> Counted:
                return self

            def __exit__(self, *exc: object) -> None:
                it.close()

            def __iter__(self) -> Counted:
                return self

            def __next__(self) -> os.DirEntry[str]:
                entry = next(it)
                listed[-1] += 1
                return entry

        return Counted()

    monkeypatch.setattr(scan_module.os, "scandir", counting)
    changes, blocked = summary(scan_dirs(upper, lower, max_entries=10))
    assert [c[:2] for c in changes] == [("many", "mkdir"), ("top.txt", "create")]
    assert blocked == [("many", "dir", "too_many")]
    assert max(listed) <= 10  # the scan never held the directory's names past the bound


def test_a_delete_past_a_bound_is_blocked_whole(layers: tuple[Path, Path]) -> None:
    lower, upper = layers
    for i in range(20):
        (lower / "d" / f"n{i:02}").write_bytes(b"n")
    whiteout(upper / "d")  # rm -r d: past the bound, none of it goes
    (upper / "top.txt").write_bytes(b"top\n")
    changes, blocked = summary(scan_dirs(upper, lower, max_entries=10))
    assert [c[:2] for c in changes] == [("top.txt", "create")]
    assert blocked == [("d", "whiteout", "too_many")]


def test_preview_is_a_bounded_unified_diff(layers: tuple[Path, Path]) -> None:
    lower, upper = layers
    (upper / "a.txt").write_bytes(b"b\n")
    (upper / "big").write_bytes(b"x" * (3 << 20))
    cs = scan_dirs(upper, lower)
    by_path = {c.path: c for c in cs.changes}
    assert by_path["a.txt"].diff == "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-a\n+b\n"
    assert by_path["big"].diff_truncated
    assert "too large to diff" in by_path["big"].diff


def test_only_the_changes_shown_get_a_preview(
    layers: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scan_module, "MAX_PREVIEWS", 2)
    lower, upper = layers
    for name in ("n1", "n2", "n3"):
        (upper / name).write_bytes(name.encode() + b"\n")
    cs = scan_dirs(upper, lower)
    assert [c.path for c in cs.changes] == ["n1", "n2", "n3"]
    assert [c.diff for c in cs.changes] == [
        "--- a/n1\n+++ b/n1\n@@ -0,0 +1 @@\n+n1\n",
        "--- a/n2\n+++ b/n2\n@@ -0,0 +1 @@\n+n2\n",
        "",
    ]


# --- a real overlay mount ----------------------------------------------------------------------


@pytest.fixture
def overlay(tmp_path: Path, layers: tuple[Path, Path]) -> Iterator[tuple[Path, Path, Path]]:
    lower, upper = layers
    work, merged = tmp_path / "work", tmp_path / "merged"
    work.mkdir()
    merged.mkdir()
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    # No skip: the working layer needs this kernel feature, so its absence is a failure.
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=True)
    try:
        yield lower, upper, merged
    finally:
        subprocess.run(["umount", str(merged)], check=True)


def test_real_overlay_mount(overlay: tuple[Path, Path, Path]) -> None:
    lower, upper, merged = overlay
    (merged / "a.txt").write_bytes(b"changed\n")
    (merged / "created.txt").write_bytes(b"new\n")
    (merged / "keep").unlink()
    os.chmod(merged / "m.sh", 0o755)
    subprocess.run(["rm", "-r", str(merged / "d")], check=True)
    (merged / "d").mkdir()
    (merged / "d" / "again").write_bytes(b"again\n")
    (merged / "newdir" / "deep").mkdir(parents=True)
    os.symlink("../etc/passwd", merged / "escape")
    os.mkfifo(merged / "pipe")
    os.link(merged / "created.txt", merged / "hard")
    before = sorted(p.name for p in lower.iterdir())
    with open(merged / "a.txt", "rb") as f:  # the command's view reads through
        assert f.read() == b"changed\n"
    subprocess.run(["umount", str(merged)], check=True)
    subprocess.run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={lower},upperdir={upper},workdir={merged.parent / 'work'}",
            str(merged),
        ],
        check=True,
    )  # remounted so the fixture's unmount holds; the layer is quiet from here on
    changes, blocked = summary(scan_dirs(upper, lower))
    assert sorted(p.name for p in lower.iterdir()) == before  # the lower is never written
    assert changes == [
        ("d/sub/y", "delete", "file", sha(b"y\n"), None, 0, None),
        ("d/sub", "delete", "dir", None, None, 0, None),
        ("d/x", "delete", "file", sha(b"x\n"), None, 0, None),
        ("keep", "delete", "file", sha(b"k\n"), None, 0, None),
        ("newdir", "mkdir", "dir", None, None, 0, 0o755),
        ("newdir/deep", "mkdir", "dir", None, None, 0, 0o755),
        ("a.txt", "replace", "file", sha(b"a\n"), sha(b"changed\n"), 8, 0o644),
        ("created.txt", "create", "file", None, sha(b"new\n"), 4, 0o644),
        ("d/again", "create", "file", None, sha(b"again\n"), 6, 0o644),
        ("escape", "create", "symlink", None, sha(b"../etc/passwd"), 13, None),
        ("hard", "create", "file", None, sha(b"new\n"), 4, 0o644),
        ("m.sh", "chmod", "file", sha(b"echo\n"), sha(b"echo\n"), 5, 0o755),
    ]
    assert blocked == [("pipe", "fifo", "fifo")]
